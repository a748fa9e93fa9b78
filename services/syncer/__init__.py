"""The syncer service: membership, scheduled rounds, merges, the outer step and publishing of global fragments."""
