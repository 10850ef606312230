"""Model families: the ``config.model_type`` registry and the generic chunked parts it drives."""
