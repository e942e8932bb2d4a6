"""Graph helpers every stage uses: new FX nodes with their fake values, what a node is, its place in the model, SDPA's
arguments, byte sizes as users write them."""
