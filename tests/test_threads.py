"""Several threads run compiled models that share one backend while other threads compile new ones: no
crash, no unequal merge, outputs equal to the same calls made one after another."""

from __future__ import annotations

import threading

import torch

from rope_dedup import RopeDedupBackend, share
from rope_dedup.testing.toy_decoder import ToyDecoder, local_global, rope_tensors

TOKENS = [torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]


def models(n: int, seed: int) -> list[torch.nn.Module]:
    built = []
    for i in range(n):
        torch.manual_seed(seed + i)
        built.append(ToyDecoder(local_global(4)).eval())
    return built


def test_threads_running_and_compiling_against_one_backend() -> None:
    references = models(6, 0)
    with torch.no_grad():
        expected = [[m(t) for t in TOKENS] for m in references]
    targets = models(6, 0)
    backend = RopeDedupBackend("eager")
    with torch.no_grad():
        running = [torch.compile(m, backend=backend) for m in targets[:2]]
        for compiled in running:
            compiled(TOKENS[0])
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            with torch.no_grad():
                if index < 2:  # already compiled: run, interning other inputs as they come
                    results[index] = [running[index](t) for t in TOKENS for _ in range(3)][::3]
                elif index < 4:  # compile new ones meanwhile
                    compiled = torch.compile(targets[index], backend=backend)
                    results[index] = [compiled(t) for t in TOKENS]
                else:  # and share others in eager, through the same store
                    share(targets[index], backend=backend)
                    results[index] = [targets[index](t) for t in TOKENS]
        except BaseException as error:  # reported below: a thread's exception would otherwise vanish
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    for index in range(6):
        for got, want in zip(results[index], expected[index]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    tables = [t for m in targets for _, t in rope_tensors(m)]
    assert len({t.untyped_storage().data_ptr() for t in tables}) == 4  # cos, sin x two thetas
    assert not backend.report.errors and not backend.report.conflicts
