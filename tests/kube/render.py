#!/usr/bin/env python3
"""tests/kube/render.py DIR IMAGE KEY_FILE [NAME=UID...]: the kustomization in DIR
as one plain YAML stream on stdout, for a tool that knows no kustomize (podman
kube play): its generated ConfigMaps and Secrets (without kustomize's name
suffixes, so that the resources' references stay as written; token.key's
content from KEY_FILE), then its resources, each in its namespace, with every
container's image `scriptgate` replaced by IMAGE, and no Namespace (podman has
none; each resource still names its namespace). podman gives a pod's Secret
files no fsGroup (they stay root's group, where Kubernetes makes them fsGroup's),
so a pod with fsGroup also gets group 0 among its supplementalGroups: its
processes may read the key as they would on Kubernetes. Each NAME=UID adds a copy of
the gateway Deployment named NAME whose pod runs as UID: a second engine. Only
the fields deploy/kubernetes uses are understood; anything else is refused."""
import base64
import copy
import os
import sys

import yaml

KNOWN = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "secretGenerator", "images"}


def main() -> None:
    d, image = sys.argv[1], sys.argv[2]
    key_file = sys.argv[3]
    extra = [a.split("=", 1) for a in sys.argv[4:]]
    k = yaml.safe_load(open(os.path.join(d, "kustomization.yaml")))
    unknown = set(k) - KNOWN
    if unknown:
        sys.exit(f"render: kustomization fields not understood: {sorted(unknown)}")
    ns = k.get("namespace")
    out = []
    for g in k.get("configMapGenerator", []):
        data = {os.path.basename(f): open(os.path.join(d, f)).read() for f in g["files"]}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": g["name"]}, "data": data})
    for g in k.get("secretGenerator", []):
        data = {}
        for f in g["files"]:
            path = key_file if os.path.basename(f) == "token.key" else os.path.join(d, f)
            data[os.path.basename(f)] = base64.b64encode(open(path, "rb").read()).decode()
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": g["name"]}, "type": "Opaque", "data": data})
    for r in k.get("resources", []):
        for doc in yaml.safe_load_all(open(os.path.join(d, r))):
            if doc and doc["kind"] != "Namespace":
                out.append(doc)
    gateway = next(doc for doc in out if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "scriptgate-gateway")
    for name, uid in extra:
        g = copy.deepcopy(gateway)
        g["metadata"]["name"] = name
        for labels in (g["metadata"]["labels"], g["spec"]["selector"]["matchLabels"], g["spec"]["template"]["metadata"]["labels"]):
            labels["app.kubernetes.io/name"] = name
        g["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = int(uid)
        out.append(g)
    for doc in out:
        if ns:
            doc.setdefault("metadata", {})["namespace"] = ns
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        sc = pod.get("securityContext", {})
        if "fsGroup" in sc:
            sc["supplementalGroups"] = sorted(set(sc.get("supplementalGroups", [])) | {0})
        for c in pod.get("containers", []):
            if c.get("image") == "scriptgate":
                c["image"] = image
    yaml.safe_dump_all(out, sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
