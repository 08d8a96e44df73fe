"""Multi-LoRA: many PEFT adapters over one base model, mixed in the same batch.

`request.py` names an adapter (`LoRARequest`, a leaf the wire messages carry);
`peft_loader.py` reads and validates a PEFT directory; `layers.py` wraps the linear layers;
`punica.py` applies every adapter of a step at once; `manager.py` (worker side) keeps the
loaded adapters and their slots. docs/LORA.md tells the whole story.
"""
