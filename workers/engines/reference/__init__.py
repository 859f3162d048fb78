"""A reference engine: SGLang's ``/generate`` protocol served by Hugging Face transformers.

It captures hidden states exactly as the hsx contract describes and, with its prefix cache on (the default),
reproduces SGLang's radix-cache truncation: a prompt that shares a prefix with an earlier one is only partly
recomputed, and only the recomputed tokens are dumped.
"""
