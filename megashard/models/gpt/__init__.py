"""GPT (``model.arch: gpt``): the decoder both architectures are built from (:mod:`.model`)."""
