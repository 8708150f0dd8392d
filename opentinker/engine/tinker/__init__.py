"""What the Tinker API runs on the engine side: a training client's model
(:mod:`.model_worker`), samplers (:mod:`.sampler_worker`) and the datum conversion (:mod:`.datums`)."""
