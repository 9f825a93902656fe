"""Command line: ``gearsam demo`` and ``gearsam partition MODEL`` (also ``python -m gearsam_fused``)."""

from __future__ import annotations

import argparse
import importlib
import sys

from torch import nn


def _load_model(spec: str) -> nn.Module:
    from .models import MODELS, get_model

    if spec in MODELS:
        return get_model(spec)
    if ":" not in spec:
        raise SystemExit(f"error: unknown model {spec!r}; use one of {sorted(MODELS)} or package.module:factory")
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"error: cannot load {spec!r}: {exc}") from None
    model = factory()
    if not isinstance(model, nn.Module):
        raise SystemExit(f"error: {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gearsam", description="SAM and GEAR-SAM for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train SGD, SAM and GEAR-SAM on scikit-learn's digits and compare")
    demo.add_argument("--epochs", type=int, default=15)
    demo.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    demo.add_argument("--rho", type=float, default=0.05)
    demo.add_argument("--beta", type=float, default=0.9)
    demo.add_argument("--lr", type=float, default=0.05)
    demo.add_argument("--label-noise", type=float, default=0.0, help="symmetric label noise rate, e.g. 0.2")
    demo.add_argument("--optimizers", nargs="+", default=None, help="subset of: sgd sam gear-sam")
    demo.add_argument("--threads", type=int, default=None)

    part = sub.add_parser("partition", help="print the block table of a model for each strategy")
    part.add_argument("model", help="an in-repo model name or package.module:factory")
    part.add_argument("--strategy", nargs="+", default=["coarse", "fine"], choices=["coarse", "fine", "tensor", "global"])

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        print(f"gearsam: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from .demo import OPTIMIZERS, DemoConfig, run_demo

        cfg = DemoConfig(
            epochs=args.epochs, seeds=tuple(args.seeds), rho=args.rho, beta=args.beta, lr=args.lr,
            label_noise=args.label_noise, optimizers=tuple(args.optimizers or OPTIMIZERS), threads=args.threads,
        )  # fmt: skip
        run_demo(cfg)
    elif args.command == "partition":
        from .partition import format_partition, partition

        model = _load_model(args.model)
        for strategy in args.strategy:
            print(f"[{args.model}: {strategy}]")
            print(format_partition(partition(model, strategy)))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
