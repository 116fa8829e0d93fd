"""Live state: placement and sharded creation, the owner (ShardingHooks), restore_and_reshard, resize."""
