"""What a layer's sync costs: the paper's formulas, the links measured by the probe, the measured
model that settles each layer's scheme, its table file, and the cost reports' exchange."""
