"""One-off (not part of the package): what one element-wise op costs to run, per op, on one thread: the
calibration's `one + one`, the same op called as aot_eager's graphs call it (`torch.ops.aten.add.Tensor`), and a
chain of 500 `x + 1.0` eager and under `torch.compile(backend="aot_eager")`, forward and forward + backward."""
import statistics
import time

import torch

torch.set_num_threads(1)
CHAIN = 500


def chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(CHAIN):
        x = x + 1.0
    return x


def per_op_us(fn, repeats: int = 20) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) / CHAIN * 1e6


def forward_backward(f):
    x = torch.ones(1, requires_grad=True)
    return lambda: f(x).sum().backward()


if __name__ == "__main__":
    one, compiled = torch.ones(1), torch.compile(chain, backend="aot_eager")
    a, b, add = torch.ones(1), torch.ones(1), torch.ops.aten.add.Tensor
    print(f"one + one: {per_op_us(lambda: [a + b for _ in range(CHAIN)]):.2f} us; "
          f"torch.ops.aten.add.Tensor: {per_op_us(lambda: [add(a, b) for _ in range(CHAIN)]):.2f} us")
    print(f"x + 1.0 chain, forward: eager {per_op_us(lambda: chain(one)):.2f} us, aot_eager "
          f"{per_op_us(lambda: compiled(one)):.2f} us; forward + backward per forward op: eager "
          f"{per_op_us(forward_backward(chain)):.2f} us, aot_eager "
          f"{per_op_us(forward_backward(torch.compile(chain, backend='aot_eager'))):.2f} us")
