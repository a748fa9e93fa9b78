"""Coordination through etcd: a bounded client (etcd), leader election with a fencing epoch
(election), and the fenced commit pointer of checkpoints (commit). See docs/failover.md."""
