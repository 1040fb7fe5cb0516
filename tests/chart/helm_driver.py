"""The real Helm engine (helm-sdkpy, Helm v4) for the chart tests, run by a Python >= 3.12
interpreter that has helm-sdkpy (the project itself supports 3.11, so this runs apart).

Usage: helm_driver.py lint CHART
       helm_driver.py install|upgrade RELEASE CHART NAMESPACE KUBECONFIG VALUES_JSON
       helm_driver.py uninstall RELEASE NAMESPACE KUBECONFIG
Prints the result as one JSON document; exits 1 with the error on stderr.
"""

import asyncio
import json
import sys

import helm_sdkpy as helm


async def main(argv: list[str]) -> object:
    verb = argv[0]
    if verb == "lint":
        return await helm.Lint(helm.Configuration()).run(argv[1])
    if verb in ("install", "upgrade"):
        release, chart, namespace, kubeconfig, values = argv[1:6]
        cfg = helm.Configuration(namespace=namespace, kubeconfig=kubeconfig)
        if verb == "install":
            return await helm.Install(cfg).run(
                release, chart, values=json.loads(values), create_namespace=True, wait=False
            )
        return await helm.Upgrade(cfg).run(release, chart, values=json.loads(values), wait=False)
    if verb == "uninstall":
        release, namespace, kubeconfig = argv[1:4]
        return await helm.Uninstall(
            helm.Configuration(namespace=namespace, kubeconfig=kubeconfig)
        ).run(release, wait=False)
    raise SystemExit(f"unknown verb {verb!r}")


try:
    print(json.dumps(asyncio.run(main(sys.argv[1:])), default=str))
except helm.HelmError as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
