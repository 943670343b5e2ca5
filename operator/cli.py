"""`hybridkv operator`: run the HybridModel operator (kopf) against the cluster of the kubeconfig or service account."""

from __future__ import annotations

import argparse
import os

from hybridkv import __version__
from hybridkv.errors import UserError

DEFAULT_SIDECAR_IMAGE = f"ghcr.io/hybridkv/hybridkv-sidecar:{__version__}"
MIN_CAPACITY_INTERVAL_S = 5.0
MAX_CAPACITY_INTERVAL_S = 3600.0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the HybridModel operator",
        description=(
            "Reconcile HybridModel resources: plan each with hybridkv.sizing, apply its sidecar Deployment and "
            "Services, and write the plan and the sidecars' measured capacity into its status."
        ),
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", "-n", action="append", default=[], help="namespace to serve (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace (needs a ClusterRole)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME", help="kopf peering object; a second operator then pauses")
    peering.add_argument("--standalone", action="store_true", help="no peering (the default)")
    parser.add_argument("--liveness", metavar="URL", help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument(
        "--capacity-interval-s",
        type=float,
        default=30.0,
        help="seconds between GetCapacity rounds over the ready sidecars (default %(default)s)",
    )
    parser.add_argument(
        "--sidecar-image", default=DEFAULT_SIDECAR_IMAGE, help="image of HybridModels that name none (default %(default)s)"
    )
    parser.add_argument(
        "--no-gpu-discovery",
        action="store_true",
        help="never list nodes for GPU labels; every HybridModel must then name spec.gpu",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging (secrets are never logged)")
    parser.set_defaults(handler=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    if not MIN_CAPACITY_INTERVAL_S <= args.capacity_interval_s <= MAX_CAPACITY_INTERVAL_S:
        raise UserError(
            f"--capacity-interval-s must be in [{MIN_CAPACITY_INTERVAL_S:g}, {MAX_CAPACITY_INTERVAL_S:g}], "
            f"got {args.capacity_interval_s:g}"
        )
    # kopf and the handlers load only when the operator runs: the CLI stays importable without them.
    import kopf

    from hybridkv.operator.handlers import SERVICE_ACCOUNT_TOKEN, OperatorConfig, build_registry, operator_memo
    from hybridkv.operator.kube import refuse_impersonation

    if not os.path.exists(SERVICE_ACCOUNT_TOKEN):
        refuse_impersonation()  # before kopf starts: a kubeconfig it would half-honour is a usage error

    config = OperatorConfig(
        sidecar_image=args.sidecar_image,
        capacity_interval_s=args.capacity_interval_s,
        gpu_discovery=not args.no_gpu_discovery,
    )
    kopf.configure(verbose=args.verbose)
    kopf.run(
        registry=build_registry(config),
        memo=operator_memo(config),
        standalone=args.peering is None,
        peering_name=args.peering,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0
