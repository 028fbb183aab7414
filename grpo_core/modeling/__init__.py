"""The models: where weights come from, loading the tokenizer, the policy and
the reference model, quantisation, precision, FP8, compilation, and the
weights an inference engine needs from the trainer's model.
"""

from grpo_core.modeling.quantization import quiet_kernel_notice

# peft imports bitsandbytes whenever it is installed, and bitsandbytes logs a
# kernel notice on import that concerns 4-bit CPU runs only: dropped before any
# module of this package can import peft (quantization.cpu_kernel_note says it where it applies).
quiet_kernel_notice()
