#!/usr/bin/env python3
"""Extracts the OpenAPI v3 schema of one version of a CustomResourceDefinition into a JSON
file, without `description` texts (which are most of a CRD's size), for the manifest checks
in tests/deploy/check_deploy.py:

    python3 deploy/schemas/crd_schema.py CRD.yaml VERSION OUT.json

The schemas committed next to this script were made from the upstream CRDs named in
deploy/schemas/README.md; the schema content is theirs (Apache License 2.0)."""
import json
import sys

import yaml


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, version, out = sys.argv[1:]
    with open(src) as f:
        crd = yaml.safe_load(f)
    spec = crd["spec"]
    for v in spec["versions"]:
        if v["name"] == version:
            schema = strip(v["schema"]["openAPIV3Schema"])
            break
    else:
        sys.exit("%s has no version %s" % (src, version))
    doc = {"group": spec["group"], "kind": spec["names"]["kind"], "version": version,
           "schema": schema}
    with open(out, "w") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"), sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
