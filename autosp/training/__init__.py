"""Training with AutoSP in the code people already have: sharded checkpoints that resume at any world size and
export to `from_pretrained` (`checkpoint`), and the HF Trainer (`hf_trainer`). User-side: the compiler core never
imports it."""
