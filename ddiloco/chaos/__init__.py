"""Fault injection for ddiloco (tests and `ddiloco chaos`): Jepsen/etcd style, scaled down to loopback.

(The services' hooks these tools drive live in the library, since services never import tools:
`ddiloco.failpoints`, named crash points armed by a `--failpoints` flag, and `ddiloco.history`, the
durable JSONL histories the syncer and learners append to with `--history-file`.)

- `schedule`: seeded fault schedules (`faults.jsonl`), replayable, and a kill loop with an MTBF;
- `proxy`: an asyncio TCP fault proxy (latency, bandwidth, resets, blackholes, partitions, flapping);
- `invariants`: the checkers I1-I5 over the recorded histories and the final state;
- `harness`: runs one scenario end to end and writes its one-line report, from its parts: `config`
  (the Scenario), `actions` (fault injection, restarts, supervision), `observe` (history tail, state
  poller), `checkpoints` (what the store kept, the held-out loss) and `report` (the Result);
- `hub`: the hub region under fire (two elected syncers on a local etcd, `etcd`);
- `cli`: `ddiloco chaos run|replay|schedule`.

Processes (services, etcd members) are started and signalled through the tools' one launcher,
`ddiloco.cli.processes`. Importing this package is cheap: the submodules are imported by name.
"""
