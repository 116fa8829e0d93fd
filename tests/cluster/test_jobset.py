"""The Kubernetes JobSet manifest, checked as far as can be done without a cluster: it parses, its pods run
the same entry point as the SLURM recipe (tests/slurm runs that one for real), and its fields are the
JobSet API's and, below ``template``, the Kubernetes Job API's as the ``kubernetes`` package describes them.

Left untested here: that a JobSet controller accepts it and restarts the set, JAX's detection of the
coordinator under Kubernetes, and a ReadWriteMany volume shared by the pods.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "examples" / "cluster"
ENTRY = ["bash", "examples/cluster/train.sh"]

# The JobSet API (jobset.x-k8s.io/v1alpha2, release 0.5 and later): no Python package ships its schema,
# so these are its fields as its API reference lists them; the Job template below is checked against the
# models of the `kubernetes` package.
JOBSET_FIELDS = {
    "JobSet": {"apiVersion", "kind", "metadata", "spec"},
    "JobSetSpec": {
        "replicatedJobs",
        "network",
        "successPolicy",
        "failurePolicy",
        "startupPolicy",
        "suspend",
        "coordinator",
        "managedBy",
        "ttlSecondsAfterFinished",
    },
    "ReplicatedJob": {"name", "groupName", "template", "replicas", "dependsOn"},
    "FailurePolicy": {"maxRestarts", "restartStrategy", "rules"},
}


def manifest() -> dict:
    return yaml.safe_load((CLUSTER / "jobset.yaml").read_text())


def unknown_fields(value, model) -> list[str]:
    """The keys of ``value`` (a manifest's dict) that the ``kubernetes`` model class ``model`` does not have,
    at any depth, each with its path."""
    import kubernetes.client as k8s

    names = {json: attr for attr, json in model.attribute_map.items()}
    out = []
    for key, item in value.items():
        if key not in names:
            out.append(f"{model.__name__}.{key}")
            continue
        kind = model.openapi_types[names[key]]
        inner = re.fullmatch(r"list\[(\w+)\]", kind)
        if inner and hasattr(k8s, inner.group(1)):
            for i, element in enumerate(item):
                out += [f"{key}[{i}].{u}" for u in unknown_fields(element, getattr(k8s, inner.group(1)))]
        elif hasattr(k8s, kind) and isinstance(item, dict):
            out += [f"{key}.{u}" for u in unknown_fields(item, getattr(k8s, kind))]
    return out


def test_the_jobset_runs_the_entry_point_the_slurm_recipe_runs():
    doc = manifest()
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    (job,) = doc["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ENTRY
    srun = [line for line in (CLUSTER / "slurm.sbatch").read_text().splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and shlex.split(srun[0])[-2:] == ENTRY
    read = set(re.findall(r"\$\{(\w+)", (CLUSTER / "train.sh").read_text()))
    given = {e["name"] for e in container["env"]}
    assert "WORKDIR" in given and given <= read, f"the JobSet sets {given - read}, which train.sh never reads"


def test_the_jobset_fields_are_the_apis():
    k8s = pytest.importorskip("kubernetes.client", reason="the kubernetes package ships the Job API's models")
    doc = manifest()
    assert set(doc) <= JOBSET_FIELDS["JobSet"]
    assert set(doc["spec"]) <= JOBSET_FIELDS["JobSetSpec"]
    assert set(doc["spec"]["failurePolicy"]) <= JOBSET_FIELDS["FailurePolicy"]
    assert unknown_fields(doc["metadata"], k8s.V1ObjectMeta) == []
    for job in doc["spec"]["replicatedJobs"]:
        assert set(job) <= JOBSET_FIELDS["ReplicatedJob"]
        assert unknown_fields(job["template"], k8s.V1JobTemplateSpec) == []
    broken = {**doc["spec"]["replicatedJobs"][0]["template"]}  # the check finds a misspelt field
    broken["spec"] = {**broken["spec"], "paralelism": 4}
    assert unknown_fields(broken, k8s.V1JobTemplateSpec) == ["spec.V1JobSpec.paralelism"]
