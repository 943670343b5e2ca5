"""`hybridkv operator`: run the HybridModel operator (kopf) against the cluster of the kubeconfig or service account."""

from __future__ import annotations

import argparse
import os
import re

from hybridkv import __version__
from hybridkv.errors import UserError

DEFAULT_SIDECAR_IMAGE = f"ghcr.io/hybridkv/hybridkv-sidecar:{__version__}"
MIN_CAPACITY_INTERVAL_S = 5.0
MAX_CAPACITY_INTERVAL_S = 3600.0
# kopf's logins, which the operator's login handler uses: this token in a pod, else a kubeconfig.
IN_CLUSTER_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
DEFAULT_KUBECONFIG = "~/.kube/config"


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
    parser.add_argument(
        "--scrape-annotations",
        action="store_true",
        help="put prometheus.io/scrape, /port and /path annotations on the sidecar pods",
    )
    parser.add_argument(
        "--operator-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="the operator's own namespace, admitted by HybridModel NetworkPolicies (default $POD_NAMESPACE)",
    )
    parser.add_argument(
        "--operator-pod-label", action="append", default=[], metavar="KEY=VALUE",
        help="a label of the operator's own pods, admitted by HybridModel NetworkPolicies (repeatable)",
    )
    parser.add_argument(
        "--scraper-namespace", help="namespace of the Prometheus that scrapes the sidecars, admitted to their metrics port"
    )
    parser.add_argument(
        "--scraper-pod-label", action="append", default=[], metavar="KEY=VALUE",
        help="a label of the scraping Prometheus pods (repeatable; none: every pod of --scraper-namespace)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging (secrets are never logged)")
    parser.set_defaults(handler=run_operator, extra="operator")


def check_credentials() -> None:
    """Raise UserError when neither login can work: kopf would otherwise retry and end in a LoginError traceback."""
    if os.path.exists(IN_CLUSTER_TOKEN_PATH):
        return
    kubeconfig = os.environ.get("KUBECONFIG")
    if kubeconfig:
        paths = [os.path.expanduser(path.strip()) for path in kubeconfig.split(os.pathsep) if path.strip()]
        absent = [path for path in paths if not os.path.isfile(path)]
        if absent:
            raise UserError(f"KUBECONFIG names {absent[0]!r}, which is not a file; point it at a kubeconfig")
        if paths:
            return
    elif os.path.isfile(os.path.expanduser(DEFAULT_KUBECONFIG)):
        return
    raise UserError(f"no Kubernetes credentials: no service-account token at {IN_CLUSTER_TOKEN_PATH} and no "
                    f"kubeconfig (KUBECONFIG is unset and {DEFAULT_KUBECONFIG} does not exist); run in a pod with "
                    "a service account, or set KUBECONFIG")


def _pod_selector(namespace: str | None, label_args: list[str], flag: str):
    """A PodSelector from a namespace flag and KEY=VALUE label flags; None without the namespace."""
    from hybridkv.operator.manifests import PodSelector
    from hybridkv.sizing.spec import DNS1123_LABEL_PATTERN, LABEL_KEY_PATTERN, LABEL_VALUE_PATTERN

    if namespace is None:
        if label_args:
            raise UserError(f"--{flag}-pod-label needs --{flag}-namespace")
        return None
    if not re.match(DNS1123_LABEL_PATTERN, namespace) or len(namespace) > 63:
        raise UserError(f"--{flag}-namespace {namespace!r} is not a namespace name")
    labels = []
    for label in label_args:
        key, sep, value = label.partition("=")
        if not sep or not re.match(LABEL_KEY_PATTERN, key) or len(value) > 63 or not re.match(LABEL_VALUE_PATTERN, value):
            raise UserError(f"--{flag}-pod-label {label!r} is not KEY=VALUE with a label key and value")
        labels.append((key, value))
    return PodSelector(namespace=namespace, labels=tuple(labels))


def run_operator(args: argparse.Namespace) -> int:
    if not MIN_CAPACITY_INTERVAL_S <= args.capacity_interval_s <= MAX_CAPACITY_INTERVAL_S:
        raise UserError(
            f"--capacity-interval-s must be in [{MIN_CAPACITY_INTERVAL_S:g}, {MAX_CAPACITY_INTERVAL_S:g}], "
            f"got {args.capacity_interval_s:g}"
        )
    operator_pods = _pod_selector(args.operator_namespace, args.operator_pod_label, "operator")
    metrics_scrapers = _pod_selector(args.scraper_namespace, args.scraper_pod_label, "scraper")
    check_credentials()
    # kopf and the handlers load only when the operator runs: the CLI stays importable without them.
    import kopf

    from hybridkv.operator.handlers import OperatorConfig, build_registry, operator_memo
    from hybridkv.operator.kube import refuse_impersonation

    if not os.path.exists(IN_CLUSTER_TOKEN_PATH):
        refuse_impersonation()  # before kopf starts: a kubeconfig it would half-honour is a usage error

    config = OperatorConfig(
        sidecar_image=args.sidecar_image,
        capacity_interval_s=args.capacity_interval_s,
        gpu_discovery=not args.no_gpu_discovery,
        scrape_annotations=args.scrape_annotations,
        operator_pods=operator_pods,
        metrics_scrapers=metrics_scrapers,
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
