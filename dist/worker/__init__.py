"""A worker's side of Algorithm 2: the solver hooks, wait-free backpropagation, the syncs in
flight and what a forward waits for, the per-iteration record, replicas, snapshots and the
timeline."""
