"""`poseidon simulate`: an event model of a cluster training a profiled net (profiles/ ships the
papers' models), its link and compute costs, and the engine that runs the model."""
