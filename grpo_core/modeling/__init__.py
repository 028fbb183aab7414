"""The models: where weights come from, loading the tokenizer, the policy and
the reference model, quantisation, precision, FP8, compilation, and the
weights an inference engine needs from the trainer's model.
"""
