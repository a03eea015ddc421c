"""The training driver: Megatron-LM's own ``pretrain()`` loop (``megatron.training``) with the
``--oases-*`` flags (:mod:`.pretrain`), fed by our ``pretrain_gpt`` pieces (:mod:`.gpt`)."""
