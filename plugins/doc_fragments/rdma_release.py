# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""The release every lingjun.rdma module that renders the chart with the Helm engine takes
(module_utils/rdma_helm.RELEASE_ARGS)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  chart_path:
    description: Directory of the chart (holds C(Chart.yaml), C(values.yaml) and C(values.schema.json)).
    type: path
    required: true
  values:
    description: Chart values (merged over the chart's C(values.yaml) as Helm does).
    type: dict
    required: true
  release_name:
    description: Release name the chart is rendered for.
    type: str
    default: rdma
  namespace:
    description: Release namespace.
    type: str
    default: kube-system
  kube_version:
    description:
      - The Kubernetes version the chart is rendered for (C(helm template --kube-version)); empty keeps Helm's
        offline default. The chart's version checks (the DRA driver's floor, 1.37) read it.
    type: str
    default: ""
"""
