"""Learner service: runs inner AdamW steps on its shard and syncs fragments with the syncer."""
