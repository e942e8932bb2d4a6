"""`autosp check` for models built in tests: `autosp.compile` on P gloo ranks against single-process training of
the same model copy on the same batches (loss, every gradient, every parameter after AdamW steps), per step.
A module's cases of one world size share one launch (`ExactnessRuns`): starting P ranks costs more than a case."""
from __future__ import annotations

import copy
import importlib
from typing import Any

import torch
import torch.distributed as dist

import autosp
from autosp.harness.check import relative_error
from autosp.harness.launch import launch

TOLERANCE = 1e-4


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _batch(vocab: int, batch_size: int, seq_len: int, step: int, ignore_fraction: float,
           documents: int = 1, padding: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens and labels; with documents > 1, `position_ids` restart at random boundaries (packed); with
    padding > 0, each row's last `padding` positions are padding (`attention_mask` 0, labels ignored)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch_size, seq_len, generator=g) < ignore_fraction] = -100
    batch = {"input_ids": ids, "labels": labels}
    if documents > 1:
        starts = torch.zeros(seq_len, dtype=torch.long)
        cuts = torch.randperm(seq_len - 1, generator=g)[:documents - 1] + 1
        starts[cuts] = cuts
        positions = torch.arange(seq_len) - starts.cummax(0).values
        batch["position_ids"] = positions.expand(batch_size, -1).clone()
    if padding:
        batch["attention_mask"] = torch.ones(batch_size, seq_len, dtype=torch.long)
        batch["attention_mask"][:, seq_len - padding:] = 0
        labels[:, seq_len - padding:] = -100
    return batch


def _rank(builder: str, options: dict, vocab: int, batch_size: int, seq_len: int, steps: int, ignore_fraction: float,
          compile_options: dict, adamw_eps: float, documents: int, padding: int) -> dict[str, float]:
    module, name = builder.rsplit(".", 1)
    model = getattr(importlib.import_module(module), name)(**options)
    # rank 0 alone trains the single-process reference and compares (`ExactnessRuns` reads rank 0's result): every
    # rank holds the same full gradients and parameters (all-reduced, or gathered at ZeRO 2/3)
    reference = copy.deepcopy(model) if dist.get_rank() == 0 else None
    # replicated unless asked (the coverage is the SP pass's; the ZeRO stages have their own matrix); at ZeRO 2/3
    # the full gradients and parameters are gathered under the model's own names
    compile_options = {"backend": "aot_eager", "sac": "off", "zero": 0, **compile_options}
    sharded = compile_options["zero"] >= 2
    compiled = _compiled(model, dict(compile_options))
    opt = (compiled.make_optimizer(torch.optim.AdamW, lr=1e-2, eps=adamw_eps) if sharded else
           torch.optim.AdamW(model.parameters(), lr=1e-2, eps=adamw_eps))
    ref_opt = None if reference is None else torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=adamw_eps)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        batch = _batch(vocab, batch_size, seq_len, step, ignore_fraction, documents, padding)
        torch.manual_seed(step)  # the same random stream for both sides (dropout)
        loss = _loss(compiled(**batch))
        loss.backward()
        grads = compiled.full_gradients() if sharded else {n: p.grad for n, p in model.named_parameters()}
        if reference is not None:
            torch.manual_seed(step)
            ref_loss = _loss(reference(**batch))
            ref_loss.backward()
            worst["loss"] = max(worst["loss"], relative_error(loss.detach(), ref_loss.detach()))
            for name, r in reference.named_parameters():
                if r.grad is not None:
                    worst["grad"] = max(worst["grad"], relative_error(grads[name], r.grad))
            ref_opt.step(), ref_opt.zero_grad()
        opt.step(), opt.zero_grad()
        params = compiled.full_parameters() if sharded else dict(model.named_parameters())
        for name, r in reference.named_parameters() if reference is not None else ():
            worst["param"] = max(worst["param"], relative_error(params[name].detach(), r.detach()))
    compared = worst if reference is not None else {}
    return {**compared, "choice": _planner_choice(compiled), "tiling": getattr(compiled, "tiling", "")}


def _compiled(model: torch.nn.Module, options: dict) -> Any:
    """`autosp.compile(model, **options)`, or with `entry="backend"` the plain `torch.compile` with
    `autosp.backend` (stage 0, replicated parameters)."""
    if options.pop("entry", "compile") == "compile":
        return autosp.compile(model, **options)
    options.pop("zero")
    return torch.compile(model, backend=autosp.backend(model=model, **options), fullgraph=True)


def _planner_choice(compiled: Any) -> dict[str, int]:
    """What the memory planner (sac auto) chose over the compiled graphs: layers recomputed token-wise, with
    attention and with its all-to-alls, bytes offloaded (all 0 under another policy, or through `autosp.backend`)."""
    if not isinstance(compiled, autosp.SequenceParallelModule):
        return {}
    plans = [r.plan for r in compiled.partition_records if r.plan is not None]
    return {"tokenwise": sum(p["tokenwise_recompute_layers"] for p in plans),
            "attention": sum(p["attention_recompute_layers"] for p in plans),
            "collectives": sum(p["collective_recompute_layers"] for p in plans),
            "offloaded_bytes": sum(r.nbytes for r in compiled.offload_reports)}


def _rank_cases(cases: dict[str, dict]) -> dict[str, dict[str, float] | str]:
    """Every case in one rank process: its worst errors, or the error it raised (the others still run)."""
    results: dict[str, dict[str, float] | str] = {}
    for name, case in cases.items():
        torch._dynamo.reset()  # each case compiles afresh, as in a process of its own
        case = dict(case)
        builder, vocab, compile_options = case.pop("builder"), case.pop("vocab"), case.pop("compile_options")
        adamw_eps = case.pop("adamw_eps")
        run = {k: case.pop(k) for k in ("batch_size", "seq_len", "steps", "ignore_fraction", "documents", "padding")}
        try:
            results[name] = _rank(builder, case, vocab, run["batch_size"], run["seq_len"], run["steps"],
                                  run["ignore_fraction"], compile_options, adamw_eps, run["documents"],
                                  run["padding"])
        except Exception as e:  # noqa: BLE001 - reported as this case's failure
            results[name] = f"{type(e).__name__}: {e}"
    return results


def precision_error(case: dict) -> dict[str, float]:
    """Single-process training of `case`'s model as built (e.g. in bf16) against the same weights in fp32, on the
    case's first batch: the relative error of the loss and the worst of every gradient's, the error the precision
    itself makes. A sharded run in that precision and the single-process one each sit about that far from the fp32
    result, so they agree within twice it when the sharding adds no error of its own."""
    case = dict(case)
    module, name = case.pop("builder").rsplit(".", 1)
    model = getattr(importlib.import_module(module), name)(**{k: case[k] for k in case if k not in _RUN_KEYS})
    wide = copy.deepcopy(model).float()
    batch = _batch(case["vocab"], case["batch_size"], case["seq_len"], 0, case["ignore_fraction"], case["documents"],
                   case["padding"])
    losses = []
    for m in (model, wide):
        torch.manual_seed(0)
        losses.append(_loss(m(**batch)).float())
        losses[-1].backward()
    grads = [relative_error(p.grad.float(), w.grad) for p, w in zip(model.parameters(), wide.parameters(), strict=True)
             if w.grad is not None]
    return {"loss": relative_error(losses[0].detach(), losses[1].detach()), "grad": max(grads)}


_RUN_KEYS = ("vocab", "batch_size", "seq_len", "steps", "ignore_fraction", "documents", "padding", "compile_options",
             "adamw_eps")


def exact_case(*, builder: str = "tests.compiler.models.build_decoder", vocab: int = 64, batch_size: int = 1,
               seq_len: int = 64, steps: int = 2, ignore_fraction: float = 0.2, documents: int = 1,
               padding: int = 0, compile_options: dict | None = None, adamw_eps: float = 1e-8, **options) -> dict:
    """One case for `ExactnessRuns`: `builder(**options)` compiled by AutoSP, trained as one process would.

    documents: packed documents per row (`position_ids` restarting at each), for models that take them.
    padding: padded positions at the end of each row (`attention_mask`), for models that take it.

    adamw_eps: AdamW's first step moves each parameter by lr * g / (|g| + eps), so a gradient entry near eps is
    resolved by its fp32 rounding, which any other summation order changes (a model whose gradient has such an
    entry needs a larger eps for its parameters to be a check of the method rather than of that rounding)."""
    return dict(builder=builder, vocab=vocab, batch_size=batch_size, seq_len=seq_len, steps=steps,
                ignore_fraction=ignore_fraction, documents=documents, padding=padding,
                compile_options=compile_options or {}, adamw_eps=adamw_eps, **options)


class ExactnessRuns:
    """The cases of one module, run in one launch per world size (P rank processes start once, not once per case)
    the first time a case of that size is asked for; each test then asserts its own case."""

    def __init__(self, cases: dict[str, tuple[int, dict]]) -> None:
        self.cases, self.results = cases, {}

    def assert_exact(self, name: str, gradient_floor: float = TOLERANCE) -> dict[str, Any]:
        """Loss, gradients and parameters within TOLERANCE; gradients within `gradient_floor` where single-process
        training itself, summed in another order, is measured to move a gradient further (its caller says where)."""
        errors, worst = self.errors(name), self._result(name)
        assert errors["grad"] <= max(TOLERANCE, gradient_floor), worst
        assert max(v for k, v in errors.items() if k != "grad") <= TOLERANCE, worst
        return worst

    def errors(self, name: str) -> dict[str, float]:
        """The case's worst relative errors (loss, grad, param) against single-process training, for a test that
        holds them to a tolerance of its own (a lower precision's)."""
        worst = self._result(name)
        assert isinstance(worst, dict), worst
        return {k: v for k, v in worst.items() if k not in ("choice", "tiling")}

    def assert_refused(self, name: str, *phrases: str) -> str:
        """The case raised AutoSP's one-line SequenceParallelError, saying each of `phrases`."""
        error = self._result(name)
        assert isinstance(error, str) and error.startswith("SequenceParallelError: "), error
        assert "\n" not in error and all(p in error for p in phrases), error
        return error

    def _result(self, name: str) -> dict[str, Any] | str:
        world_size, _ = self.cases[name]
        if name not in self.results:
            batch = {n: case for n, (p, case) in self.cases.items() if p == world_size}
            outcome = launch(_rank_cases, (batch,), world_size=world_size, timeout_s=400 + 200 * len(batch))
            assert outcome.status == "ok", f"{outcome.error}\n{outcome.output_tail}"
            self.results.update(outcome.results[0])
        return self.results[name]
