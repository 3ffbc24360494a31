"""llamatrace: run a GGUF model (Llama, Qwen, Phi-3, Gemma, gpt-oss; mixtures of experts, Qwen3.5's DeltaNet hybrids) on the CPU and trace every stage of its forward pass.

Python use::

    from llamatrace import Llama
    model = Llama.load("model.gguf")
    ids = model.tokenizer.encode("The capital of France is")
    with model.trace(layers=[0], stages=["kq*"], stats=True) as rec:
        tokens = list(model.generate(ids, max_tokens=8))
    for event in rec.events:
        print(event.step, event.layer, event.stage, event.shape, event.stats["rms"])
"""

__version__ = "0.1.0"

# Importing llamatrace changes no process-wide setting (Numba's threading layer, its cache
# folder, libtbb): llamatrace's own entry points do that, see llamatrace.machine.runtime.


def __getattr__(name: str):
    if name == "Llama":
        from llamatrace.model.llama import Llama
        return Llama
    raise AttributeError(name)
