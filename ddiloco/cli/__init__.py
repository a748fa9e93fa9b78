"""Command-line entry points: `ddiloco up|status|syncer|learner|checkpoint|evaluate`."""
