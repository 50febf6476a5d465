"""The part of ``kustomize build`` that deploy/kubernetes/ uses, for rendering its overlays where the real kustomize
is not installed (pykustomize, Go's kustomize in a Python wheel, asks for Python 3.14): each kustomization's
``resources`` (files and directories), ``namespace``, ``nameSuffix``, ``images`` (newName/newTag), ``patches``
(JSON 6902, inline or from a file; targets by group, kind, name or a label selector ``key=value``) and
``configMapGenerator`` (files, with ``generatorOptions.disableNameSuffixHash``). Anything else in a
kustomization is refused, so the manifests cannot come to rely on a feature this does not render;
tests/deploy/test_kubernetes_manifests.py compares its output with the real kustomize's where that is installed."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "nameSuffix", "images", "patches",
                "configMapGenerator", "generatorOptions"}
# Kinds without a namespace that the manifests could hold (the rest are namespaced).
CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume"}


class Resource:
    """One object and the name it was first given (kustomize matches patch targets on either)."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.original_name = doc["metadata"]["name"]


def build(directory: str | Path) -> list[dict]:
    """The objects ``kustomize build directory`` prints, in no particular order."""
    return [r.doc for r in _build(Path(directory))]


def _build(root: Path) -> list[Resource]:
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(k) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{root}: kustomization fields this renderer does not implement: {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in k.get("resources", []):
        path = root / entry
        if path.is_dir():
            resources += _build(path)
        else:
            resources += [Resource(d) for d in yaml.safe_load_all(path.read_text()) if d]
    hash_names = not k.get("generatorOptions", {}).get("disableNameSuffixHash", False)
    for gen in k.get("configMapGenerator", []):
        if hash_names or set(gen) - {"name", "files"}:
            raise ValueError(f"{root}: only configMapGenerator files without a name hash are implemented")
        data = {Path(f).name: (root / f).read_text() for f in gen["files"]}
        resources.append(Resource({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]},
                                   "data": data}))
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else (root / patch["path"]).read_text())
        targets = [r for r in resources if _matches(r, patch["target"])]
        if not targets:
            raise ValueError(f"{root}: patch target {patch['target']} matches nothing")
        for r in targets:
            for op in ops:
                _apply(r.doc, op)
    if "nameSuffix" in k:
        for r in resources:
            r.doc["metadata"]["name"] += k["nameSuffix"]
    if "namespace" in k:
        for r in resources:
            if r.doc["kind"] not in CLUSTER_KINDS:
                r.doc["metadata"]["namespace"] = k["namespace"]
            for subject in r.doc.get("subjects", []) if r.doc["kind"] in ("RoleBinding", "ClusterRoleBinding") else []:
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = k["namespace"]
    for image in k.get("images", []):
        for r in resources:
            for container in _containers(r.doc):
                name, _, tag = container["image"].rpartition(":")
                if not name or "/" in tag:  # no tag (a colon, if any, is a registry's port)
                    name = container["image"]
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return resources


def _matches(r: Resource, target: dict) -> bool:
    api_version = r.doc["apiVersion"]
    group = api_version.rpartition("/")[0]
    if "group" in target and target["group"] != group or "kind" in target and target["kind"] != r.doc["kind"]:
        return False
    if "name" in target and target["name"] not in (r.original_name, r.doc["metadata"]["name"]):
        return False
    if "labelSelector" in target:
        key, _, value = target["labelSelector"].partition("=")
        if r.doc["metadata"].get("labels", {}).get(key) != value:
            return False
    return True


def _apply(doc: dict, op: dict) -> None:
    """One JSON 6902 operation (add, replace, remove) on ``doc`` in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif op["op"] in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(node, list):
            if last == "-":
                node.append(value)
            elif op["op"] == "add":
                node.insert(int(last), value)
            else:
                node[int(last)] = value
        else:
            if op["op"] == "replace" and last not in node:
                raise KeyError(f"replace of a missing {op['path']}")
            node[last] = value
    else:
        raise ValueError(f"JSON patch op {op['op']!r} is not implemented")


def _containers(doc: dict):
    """Every container and init container of every pod spec in ``doc`` (a Deployment's template, a
    LeaderWorkerSet's leader and worker templates): kustomize's image transformer reaches them all."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from _containers(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _containers(item)
