"""The model surgery: transformers registration, ``apply``, forward patches, layer wrappers, SP generation
(no algorithm code, no trainer code: the trainer adapters live in :mod:`hf_fpdt.trainers`)."""
