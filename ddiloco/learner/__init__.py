"""The learner's library: what every learner runs, the `services/learner` process and a user's own
training loop alike (`ddiloco.Learner`, docs/python-api.md).

  client.py, uploads.py  SyncClient: the connection to the syncer, on a background thread
  targets.py             which syncer the next session goes to (leader election)
  leader_watch.py        leaves a silent leader once another syncer of the list leads
  ports.py               the client interface the loop uses (SyncClientLike), a null client
  loop.py                LearnerLoop: fragments, round calls, rebase on arrival, finish
  snapshot.py            the learner's durable local state (resume)
  api.py                 ddiloco.Learner, the loop driven by the user's own inner step

Nothing here reads flags or the environment, nor imports `services` (tests/unit/test_layers.py).
"""
