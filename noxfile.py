"""The project's test sessions, each in a venv of its own: ``nox`` runs the default ones (what CI runs).

    nox                          # tests, newest, transformers4, the import contract, the type check: every default
    nox -s torch                 # the fast suite on every supported torch release
    nox -s "torch(version='2.11.0')"
    nox -r                       # reuse the venvs of an earlier run (much faster locally)
    nox -s newest                # per-layer config tests on the newest transformers (a default session)
    nox -s zoo                   # not a default: every RoPE architecture of transformers 4.44.2, 5.23.0 and
                                 # 5.25.0 (one session per release)

Arguments after ``--`` go to pytest: ``nox -s tests -- tests/test_pass.py -x``.

torch comes first in every venv, pinned: 2.13.0 is the CPU wheel on this machine's disk, and an open range on
a machine without torch would pull a multi-GB CUDA build. The project is installed after it, so its range is
already satisfied and pip keeps that torch.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "newest", "transformers4", "imports", "typecheck"]

CI_TORCH = "2.13.0"
# The releases docs/testing.md's table of torch releases was measured on.
TORCH_RELEASES = ["2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
# torchtitan's model code without its training stack (datasets, wandb, tensorboard, ...), which would
# pull a second torch.
TORCHTITAN = ["torchtitan==0.3.0", "spmd_types==0.2.3"]
TORCHTITAN_DEPS = ["tyro==1.0.17"]
PYTEST = ["python", "-m", "pytest", "-n", "2"]
# Seconds a registry sweep may take before it stops and fails: measured 7-20 min (5.x) and 1-2 min (4.x) on 2
# shared cores (docs/zoo.md), with room for a slower machine.
ZOO_BUDGET = "2700"
# The newest transformers the registry had when the zoo was last swept: the fast suite runs on 5.23.0 (the
# test extra's pin), and the ``newest`` session runs this release's per-layer config tests.
NEWEST_TRANSFORMERS = "5.25.0"
# The releases the zoo is swept on (docs/zoo.md has a table for each).
ZOO_RELEASES = ["4.44.2", "5.23.0", NEWEST_TRANSFORMERS]
# The fast suite's tests that the newest release must pass too: the pinned types whose layers read their own
# config (head_dim per layer), the one whose RoPE the kernels hub's module-level apply_rotary_pos_emb applies
# (flint: a finding only if the audit credits the layer, not that module), and the config reader's per-layer
# tests.
NEWEST_TESTS = ["tests/test_zoo.py", "tests/test_config_reader.py", "-k",
                "embedding_gemma2_text or gemma4_unified_text or flint or per_layer"]
MYPY = "mypy==2.4.1"


def install(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """pip install without compiling every installed module to bytecode: torch alone is some 20,000 files (85 s
    against 15 s on 2 busy cores); Python compiles the modules a session imports when it first imports them.
    It must be let write them: with PYTHONDONTWRITEBYTECODE set (as on this project's machines), every process
    would compile torch and transformers again, 7 s each, and the tests start hundreds of processes."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty: unset, for Python
    session.install("--no-compile", *args, env=env)


def install_test_env(session: nox.Session, torch_version: str, env: dict[str, str] | None = None) -> None:
    install(session, f"torch=={torch_version}", env=env)
    # Naming torch again holds it at that version while the project's requirements resolve.
    install(session, "-e", ".[test]", f"torch=={torch_version}", env=env)
    install(session, "--no-deps", *TORCHTITAN, env=env)
    install(session, *TORCHTITAN_DEPS, f"torch=={torch_version}", env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """The fast default suite on CI's torch, torchtitan's models and Lightning Fabric included."""
    install_test_env(session, CI_TORCH)
    session.run(*PYTEST, *session.posargs)


@nox.session
def newest(session: nox.Session) -> None:
    """The per-layer config tests of the fast suite on the newest transformers (NEWEST_TRANSFORMERS)."""
    install(session, f"torch=={CI_TORCH}")
    install(session, "-e", ".", "pytest>=8", "pytest-xdist>=3", f"transformers=={NEWEST_TRANSFORMERS}",
            f"torch=={CI_TORCH}")
    session.run(*PYTEST, *(session.posargs or NEWEST_TESTS))


@nox.session
def transformers4(session: nox.Session) -> None:
    """transformers 4.x models (per-attention caches): 4.x cannot share a venv with the 5.x of ``tests``. The
    sweep of every 4.44.2 RoPE model type is ``nox -s "zoo(transformers='4.44.2')"``."""
    install(session, f"torch=={CI_TORCH}")
    install(session, "-e", ".[test-transformers4]", f"torch=={CI_TORCH}")
    session.run(*PYTEST, *(session.posargs or ["tests/test_transformers4.py"]))


@nox.session
@nox.parametrize("transformers", ZOO_RELEASES)
def zoo(session: nox.Session, transformers: str) -> None:
    """Not a default session (1-20 min per release): every RoPE model type of one transformers release built
    tiny, through the static audit, the dynamic audit and share(); fails on an exception from rope_dedup,
    audits that disagree, a changed output, an unexplained finding, or a docs/zoo.md table that says otherwise.
    ``nox -s "zoo(transformers='5.25.0')" -- llama gemma3`` sweeps some types; ``-- --write`` rewrites that
    release's table."""
    install(session, f"torch=={CI_TORCH}")
    # pillow as the test extra has it (through matplotlib): without it, image models that need timm say they
    # need PIL first, and the tables name what is missing as the fast suite's venv sees it.
    install(session, "-e", ".", f"transformers=={transformers}", "pillow==13.0.0", f"torch=={CI_TORCH}")
    session.run("python", "tests/zoo_sweep.py", "--budget", ZOO_BUDGET, *(session.posargs or ["--check"]))


@nox.session
def imports(session: nox.Session) -> None:
    """The import contract in pyproject.toml ([tool.importlinter]): tools -> audit -> sharing -> core, and
    no graph pass importing another. Checked on the installed package, not the source tree: passes/
    installs as rope_dedup.passes, which the tree does not nest."""
    # import-linter reads the sources; it imports nothing, so the package goes in without torch.
    install(session, "--no-deps", ".")
    install(session, "import-linter==2.17")
    config = str(Path(__file__).resolve().parent / "pyproject.toml")
    session.chdir(session.create_tmp())  # away from the source tree: rope_dedup comes from site-packages
    session.run("lint-imports", config)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the package as it installs (passes/ becomes rope_dedup.passes, which the source tree does not
    nest) and over tests/typing_user.py, a user's typed script, at the strictness pyproject.toml's [tool.mypy]
    declares. Errors name files in the session's install folder; the same paths under rope_dedup/ (or passes/)
    are the sources."""
    install(session, f"torch=={CI_TORCH}", MYPY)  # torch for its type information
    site = Path(session.create_tmp()) / "site"
    install(session, "--no-deps", "--target", str(site), "--upgrade", ".")
    session.run("mypy", "--config-file", "pyproject.toml", "--cache-dir", str(site.parent / "mypy-cache"),
                str(site / "rope_dedup"), "tests/typing_user.py", env={"MYPYPATH": str(site)})


@nox.session
@nox.parametrize("version", TORCH_RELEASES)
def torch(session: nox.Session, version: str) -> None:
    """The fast suite on one torch release. Releases other than 2.13.0 are the registry's default (CUDA)
    builds, several GB each, which run on CPU; this machine's pip constraint caps torch, so it is lifted
    here, and the exact pin above keeps every other install at this version."""
    install_test_env(session, version, env={"PIP_CONSTRAINT": "/dev/null"})
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run(*PYTEST, *session.posargs)
