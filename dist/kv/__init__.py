"""The sharded key-value store: a server's KV pairs with their BSP counters and solver state, and
a worker's client for them."""
