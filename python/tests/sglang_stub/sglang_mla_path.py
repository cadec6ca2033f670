"""A test-only SGLang plugin (``kvferry_sglang_mla_path-0.dist-info`` beside it makes SGLang find
it on ``PYTHONPATH``) that works around a bug of SGLang 0.5.23's CPU engine, so that a tiny MLA
model's outputs can be compared at all.

For an extend batch without a cached prefix, DeepSeek's MLA attention on the ``torch_native``
backend takes its MHA path: attention over the new tokens' own K and V. ``torch_native``'s
``forward_extend`` ignores the K and V it is given and attends over the KV pool, which holds the
compressed latent cache: the outputs are wrong (or, when the shapes differ, it raises). This
plugin sends every batch down the absorbed MLA path instead, which attends over the latent cache
as it should; SGLang's greedy outputs then equal HF transformers'. It changes no KV layout: the
pool is SGLang's ``MLATokenToKVPool`` either way.
"""


def register() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    AttentionBackendRegistry.register("torch_native", lambda attn, fallback: AttnForwardMethod.MLA)
