"""The coordinator beside worker 0 and what it hands out: the information book (layers, KV pairs,
bundles and their placement), the control messages and the rules every message must pass, the
collectives, and the replicas' consistency checks."""
