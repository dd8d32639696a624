"""Two-process smoke test of the raw CUDA calls relayd's GPU paths stand on.

``python -m tests.gpu._ipc_smoke --json OUT.json --md OUT.md [--timeout S]``

Each call is reported as works / fails with its error, so a GPU that
refuses IPC (a sandbox, a container without the host's IPC namespace) is a
finding, not a crash:

* ``ipc_mem_export`` / ``ipc_mem_import``: a CUDA storage exported with
  ``UntypedStorage._share_cuda_`` (``cudaIpcGetMemHandle``) in this process,
  opened with ``_new_shared_cuda`` (``cudaIpcOpenMemHandle``) in a child,
  whose checksum of the bytes must match;
* ``ipc_event_export`` / ``ipc_event_import``: an interprocess event
  recorded here after a producer on a side stream, opened with
  ``Event.from_ipc_handle`` in the child, which waits on it before reading;
* ``host_register_shm``: ``cudaHostRegister`` of an mmap of a ``/dev/shm``
  file (the arena's page-locked staging), then a copy from it to the GPU.

Exit status: 0 every call works; 1 some call fails (see the report); 2 no
CUDA device (the report says so; nothing else is tried). The JSON and the
markdown are written in every case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import subprocess
import sys
import time
from typing import Any

NBYTES = 4 << 20
# cudaHostRegisterPortable, as relayd_client._cuda_staging pins the arena.
_HOST_REGISTER_PORTABLE = 1
STEPS = (
    ("ipc_mem_export", "CUDA IPC memory handle export (cudaIpcGetMemHandle)"),
    ("ipc_mem_import", "CUDA IPC memory handle import in a second process (cudaIpcOpenMemHandle)"),
    ("ipc_event_export", "interprocess CUDA event export (cudaIpcGetEventHandle)"),
    ("ipc_event_import", "interprocess CUDA event import and wait in a second process"),
    ("host_register_shm", "cudaHostRegister on an mmap of /dev/shm, then a copy to the GPU"),
)
NO_CUDA = "no CUDA device"


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _checksum(t: Any) -> int:
    # Sum of bytes weighted by position mod 251: order matters, ints stay exact.
    import torch

    flat = t.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 251 + 1
    return int((flat * weights).sum().item())


def host_register_shm() -> dict[str, Any]:
    import torch

    path = f"/dev/shm/relayd-smoke-{os.getpid()}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return {"ok": False, "error": f"cannot create {path}: {_err(exc)}"}
    try:
        os.ftruncate(fd, NBYTES)
        mm = mmap.mmap(fd, NBYTES)
        view = torch.frombuffer(mm, dtype=torch.uint8)
        view[:] = 7
        cudart: Any = torch.cuda.cudart()
        rc = int(cudart.cudaHostRegister(int(view.data_ptr()), NBYTES, _HOST_REGISTER_PORTABLE))
        if rc != 0:
            from relayd_client._cuda_staging import _clear_cuda_error

            _clear_cuda_error()
            return {"ok": False, "error": f"cudaHostRegister returned error {rc}"}
        try:
            on_gpu = view.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            if int(on_gpu.sum().item()) != 7 * NBYTES:
                return {"ok": False, "error": "registered, but the copy to the GPU differs"}
        finally:
            cudart.cudaHostUnregister(int(view.data_ptr()))
        del view
        mm.close()
        return {"ok": True, "detail": f"{NBYTES} bytes page-locked and copied"}
    except Exception as exc:
        return {"ok": False, "error": _err(exc)}
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


def child() -> None:
    """Open what the parent exported (as JSON on stdin); JSON results on stdout."""
    import torch

    spec = json.loads(sys.stdin.readline())
    out: dict[str, Any] = {}
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    event = None
    try:
        event = torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(spec["event"]))
        torch.cuda.current_stream().wait_event(event)
        out["ipc_event_import"] = {"ok": True, "detail": "opened; the reader's stream waits on it"}
    except Exception as exc:
        out["ipc_event_import"] = {"ok": False, "error": _err(exc)}
    try:
        h = spec["share"]
        storage = torch.UntypedStorage._new_shared_cuda(
            0,
            bytes.fromhex(h["handle"]),
            h["size"],
            h["offset"],
            bytes.fromhex(h["ref_handle"]),
            h["ref_offset"],
            bytes.fromhex(h["event_handle"]),
            h["event_sync"],
        )
        t = torch.empty((0,), dtype=torch.uint8, device=device).set_(storage, 0, (NBYTES,), (1,))
        out["ipc_mem_import"] = {
            "ok": True,
            "detail": "opened; bytes match the writer's",
            "checksum": _checksum(t),
        }
        del t, storage
    except Exception as exc:
        out["ipc_mem_import"] = {"ok": False, "error": _err(exc)}
    print(json.dumps(out), flush=True)


def parent(timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(facts, results by step)."""
    facts: dict[str, Any] = {"python": sys.version.split()[0]}
    results: dict[str, Any] = {}
    try:
        import torch
    except Exception as exc:
        facts["finding"] = f"{NO_CUDA}: torch does not import ({_err(exc)})"
        return facts, results
    facts["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    try:
        available = bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception as exc:
        available = False
        facts["cuda_error"] = _err(exc)
    if not available:
        why = "a CPU build of torch" if torch.version.cuda is None else "torch sees no device"
        facts["finding"] = f"{NO_CUDA}: {why}; the GPU paths cannot be exercised here"
        return facts, results
    facts["devices"] = torch.cuda.device_count()
    facts["gpu"] = torch.cuda.get_device_name(0)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    spec: dict[str, Any] = {}
    src = None
    event = None
    try:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            # A producer that is still running when the handles leave.
            a = torch.randn(2048, 2048, device=device)
            for _ in range(20):
                a = torch.tanh(a @ a / 64.0)
            src = a.reshape(-1).view(torch.uint8)[:NBYTES].clone()
        try:
            share = src.untyped_storage()._share_cuda_()
            _dev, handle, size, offset, ref_h, ref_off, ev_h, ev_sync = share
            spec["share"] = {
                "handle": bytes(handle).hex(),
                "size": int(size),
                "offset": int(offset),
                "ref_handle": bytes(ref_h or b"").hex(),
                "ref_offset": int(ref_off),
                "event_handle": bytes(ev_h or b"").hex(),
                "event_sync": bool(ev_sync),
            }
            results["ipc_mem_export"] = {"ok": True, "detail": f"{int(size)} bytes"}
        except Exception as exc:
            results["ipc_mem_export"] = {"ok": False, "error": _err(exc)}
        try:
            event = torch.cuda.Event(interprocess=True)
            event.record(side)
            spec["event"] = bytes(event.ipc_handle()).hex()
            results["ipc_event_export"] = {"ok": True, "detail": "recorded after the producer"}
        except Exception as exc:
            results["ipc_event_export"] = {"ok": False, "error": _err(exc)}
    except Exception as exc:
        facts["setup_error"] = _err(exc)
    if "share" in spec and "event" in spec:
        # The child reads while the producer may still run; compared afterwards.
        results.update(_run_child(spec, timeout))
        imported = results["ipc_mem_import"]
        if imported.get("ok") and src is not None:
            torch.cuda.synchronize()
            if imported.pop("checksum") != _checksum(src):
                results["ipc_mem_import"] = {
                    "ok": False,
                    "error": "opened, but the bytes read differ from the writer's "
                    "(the imported event did not order the read)",
                }
    else:
        for step in ("ipc_mem_import", "ipc_event_import"):
            results[step] = {"ok": False, "error": "not tried: the export failed"}
    results["host_register_shm"] = host_register_shm()
    del src, event
    return facts, results


def _run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.gpu._ipc_smoke", "--child"],
            input=json.dumps(spec) + "\n",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        why = f"the second process did not finish within {timeout:.0f} s (a hung import or wait)"
        return {s: {"ok": False, "error": why} for s in ("ipc_mem_import", "ipc_event_import")}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        why = f"the second process failed (exit {proc.returncode}): {tail}"
        return {s: {"ok": False, "error": why} for s in ("ipc_mem_import", "ipc_event_import")}
    out = dict(json.loads(lines[-1]))
    for r in out.values():
        r["seconds"] = round(time.monotonic() - started, 2)
    return out


def render(facts: dict[str, Any], results: dict[str, Any]) -> str:
    lines = ["## CUDA IPC smoke test (two processes)", ""]
    lines += [f"- {k}: {v}" for k, v in facts.items() if k != "finding"]
    if "finding" in facts:
        lines += ["", f"**{facts['finding']}**"]
        return "\n".join(lines) + "\n"
    for step, what in STEPS:
        r = results.get(step, {"ok": False, "error": "not tried"})
        verdict = "works" if r["ok"] else "FAILS"
        more = r.get("detail") if r["ok"] else r.get("error")
        lines.append(f"- {what}: **{verdict}**" + (f" ({more})" if more else ""))
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    if args.child:
        child()
        return 0
    facts, results = parent(args.timeout)
    text = render(facts, results)
    print(text, end="", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"facts": facts, "results": results}, f, indent=1)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)
    if "finding" in facts:
        return 2
    return 0 if all(results.get(s, {}).get("ok") for s, _ in STEPS) else 1


if __name__ == "__main__":
    sys.exit(main())
