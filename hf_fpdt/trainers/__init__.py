"""The trainer adapters: the Accelerate plugin, HF Trainer and TRL trainers, above the model surgery."""
