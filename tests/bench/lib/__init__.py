"""What the benchmarks share: workloads, the fleet simulator, peers' drafters, engine replicas and clients."""
