"""The ZeRO-3 hook calibration (`autosp.experiments.calibrate._zero3_hook`'s method) on two engines, paired: its 16
linear layers and a 4-layer HF Llama (hidden 128, MLP 448, 64 tokens). Host CPU seconds per coordinator call,
outside DeepSpeed's collectives, per rank. A one-off diagnostic, not part of the package.

    PYTHONPATH=$REPO:$PWD python hf_per_call.py
"""
import torch

from autosp.experiments import calibrate as cal


def per_call(repeats: int, kind: str) -> dict:
    from baselines.deepspeed_env import import_deepspeed

    deepspeed = import_deepspeed("zero3")
    if kind == "linear":
        out, into = cal.HOOK_SHAPE

        def make() -> torch.nn.Module:
            return torch.nn.Sequential(*(torch.nn.Linear(into, out, bias=False) if i % 2 == 0 else
                                         torch.nn.Linear(out, into, bias=False) for i in range(cal.HOOK_LAYERS)))
        x = torch.randn(64, into)

        def loss(model: torch.nn.Module) -> torch.Tensor:
            return model(x).sum()
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=448, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)

        def make() -> torch.nn.Module:
            torch.manual_seed(0)
            return LlamaForCausalLM(config)
        ids = torch.randint(0, 512, (1, 64))

        def loss(model: torch.nn.Module) -> torch.Tensor:
            return model(input_ids=ids, labels=ids).loss
    plain, sharded = make(), make()
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 2**31 - 1,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False}}
    engine, *_ = deepspeed.initialize(model=sharded, optimizer=torch.optim.SGD(sharded.parameters(), lr=0.0),
                                      config=ds_config)

    def sharded_step() -> None:
        engine.backward(loss(engine))

    def plain_step() -> None:
        loss(plain).backward()

    with cal._clock_outside_collectives() as clock:
        extra = cal._seconds(sharded_step, repeats, clock=clock) - cal._seconds(plain_step, repeats, clock=clock)
    calls = cal._coordinator_calls(sharded_step)
    return {"kind": kind, "calls": calls, "per_call_us": round(extra / calls * 1e6, 1)}


if __name__ == "__main__":
    from hf_per_call import per_call as importable  # the ranks import it by module name, not from __main__

    from autosp.harness.launch import launch_local

    for kind in ("linear", "hf", "linear", "hf"):
        result = launch_local(importable, (7, kind), world_size=2, device="cpu", timeout_s=600)
        print(result.status, result.error, result.results, flush=True)
