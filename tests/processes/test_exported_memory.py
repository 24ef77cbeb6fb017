"""Host memory moved into shared memory in place, and a same-host peer mapping it read-only."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import select
import subprocess
import sys

import pytest
import torch

from harness import procs
from harness.tensors import random_tensor, same_bits
from kv_pipe import KVTransferConfig, TorchDistributedPipe, exported_memory
from kv_pipe.errors import KVConfigError, KVProtocolError
from kv_pipe.exported_memory import F_SEAL_FUTURE_WRITE, REQUIRED_SEALS, ExportDescriptor, export_host_memory

PAGE = os.sysconf("SC_PAGE_SIZE")


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(ctypes.string_at(address, nbytes)), dtype=torch.uint8)


def _flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool])
def test_export_keeps_contents_addresses_and_views(dtype):
    generator = torch.Generator().manual_seed(3)
    tensor = random_tensor(generator, dtype, (37, 1031))  # odd sizes: the storage starts and ends mid-page
    before = tensor.clone()
    address = tensor.data_ptr()
    view = tensor[5:9, 3:]
    export = export_host_memory(view)  # any view exports its whole storage
    assert tensor.data_ptr() == address and same_bits(tensor, before)
    start, end = address, address + tensor.nbytes
    assert export.address == -(-start // PAGE) * PAGE and export.address + export.nbytes == end // PAGE * PAGE
    # The export's file holds what the tensor holds, and a write through any view reaches it.
    replacement = random_tensor(generator, dtype, tuple(view.shape))
    view.copy_(replacement)
    assert same_bits(tensor[5:9, 3:], replacement)
    with open(f"/proc/self/fd/{export.descriptor.fd}", "rb") as file:
        in_file = torch.frombuffer(bytearray(file.read()), dtype=torch.uint8)
    inside = _flat_bits(tensor)[export.address - start : export.address - start + export.nbytes]
    assert torch.equal(in_file, inside)
    assert fcntl.fcntl(export.descriptor.fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
    assert export_host_memory(tensor) == export  # once per storage
    del tensor, view  # the export keeps the storage: its pages are never handed to anything else
    assert export.storage.data_ptr() == start
    assert torch.equal(_bytes_at(export.address, export.nbytes), inside)


def test_export_refuses_what_it_cannot_share():
    with pytest.raises(KVConfigError, match="no whole page"):
        export_host_memory(torch.ones(PAGE // 8, dtype=torch.uint8))
    big = torch.rand(1 << 20)
    export_host_memory(big[: 1 << 19])
    part = torch.from_numpy(big.numpy()[PAGE:])  # another storage over the same pages
    with pytest.raises(KVConfigError, match="overlaps"):
        export_host_memory(part)


def test_offsets_of_an_export_are_bounded():
    tensor = torch.rand(1 << 16)
    export = export_host_memory(tensor)
    assert export.offset_of(export.address, export.nbytes) == 0
    assert export.offset_of(export.address + 8, 16) == 8
    assert export.offset_of(export.address - 1, 1) is None
    assert export.offset_of(export.address + export.nbytes - 4, 8) is None


# A process of the same user opens the export through /proc as a peer would, but read-write, and
# tries every way to change it; then it maps it as a peer does and reports what it reads there.
_INTRUDER = r"""
import ctypes, errno, json, mmap, os, sys
from kv_pipe.exported_memory import ExportDescriptor, PeerMemory

pid, fd, inode, nbytes = (int(word) for word in sys.argv[1:])
path = f"/proc/{pid}/fd/{fd}"
libc = ctypes.CDLL(None, use_errno=True)
outcomes = {}


def attempt(name, change):
    try:
        writable = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            change(writable)
        finally:
            os.close(writable)
        outcomes[name] = "changed"
    except OSError as exc:
        outcomes[name] = errno.errorcode.get(exc.errno, str(exc))


def map_writable(writable):
    with mmap.mmap(writable, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
        mapping[:8] = bytes(8 * [0xFF])


def punch_a_hole(writable):  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: the pages read as zeros
    if libc.fallocate(writable, 3, ctypes.c_long(0), ctypes.c_long(nbytes)):
        raise OSError(ctypes.get_errno(), "fallocate")


attempt("map writable", map_writable)
attempt("pwrite", lambda writable: os.pwrite(writable, bytes(8 * [0xFF]), 0))
attempt("write", lambda writable: os.write(writable, bytes(8 * [0xFF])))
attempt("punch a hole", punch_a_hole)
peer = PeerMemory.open(pid, ExportDescriptor(fd, inode, nbytes))
if libc.mprotect(ctypes.c_void_p(peer.address), ctypes.c_size_t(nbytes), mmap.PROT_READ | mmap.PROT_WRITE):
    outcomes["make the peer mapping writable"] = errno.errorcode[ctypes.get_errno()]
else:
    outcomes["make the peer mapping writable"] = "changed"
print(json.dumps(outcomes), flush=True)
sys.stdin.readline()  # the exporter writes through its own tensor meanwhile
print(ctypes.string_at(peer.address, nbytes).hex(), flush=True)
"""


def test_nobody_but_the_exporter_can_write_an_export():
    generator = torch.Generator().manual_seed(11)
    tensor = random_tensor(generator, torch.float32, (3, 3001))
    before = tensor.clone()
    export = export_host_memory(tensor)
    head, nbytes = export.address - tensor.data_ptr(), export.nbytes
    assert fcntl.fcntl(export.descriptor.fd, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE
    descriptor = export.descriptor
    intruder = subprocess.Popen(
        [sys.executable, "-c", _INTRUDER, str(os.getpid()), str(descriptor.fd), str(descriptor.inode), str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=procs.REPO,
    )
    try:
        assert select.select([intruder.stdout], [], [], 120)[0], "the intruder did not report in time"
        outcomes = json.loads(intruder.stdout.readline())
        assert outcomes == {
            "map writable": "EPERM",
            "pwrite": "EPERM",
            "write": "EPERM",
            "punch a hole": "EPERM",
            "make the peer mapping writable": "EACCES",
        }, outcomes
        assert same_bits(tensor, before)  # not a bit changed
        # The exporter's own mapping, made before the seal, still writes; the peer's mapping sees it.
        replacement = random_tensor(generator, torch.float32, (3, 3001))
        tensor.copy_(replacement)
        assert same_bits(tensor, replacement)
        seen, _ = intruder.communicate("go\n", timeout=120)
    finally:
        if intruder.poll() is None:
            intruder.kill()
        intruder.wait(timeout=30)
    assert intruder.returncode == 0
    assert bytes.fromhex(seen.strip()) == _flat_bits(replacement)[head : head + nbytes].numpy().tobytes()


# Run as root, a process gives up CAP_SYS_PTRACE: it is then an ordinary process of its user, that may
# open another's /proc/PID/fd only while that one is dumpable (both give it up: a tracer must hold
# every capability its target holds).
_UNPRIVILEGED = r"""
import ctypes, os
if os.geteuid() == 0:
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; twice
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.capget(header, data) == 0
    data[0] &= ~(1 << 19)  # CAP_SYS_PTRACE, effective
    data[1] &= ~(1 << 19)  # and permitted
    assert libc.capset(header, data) == 0, ctypes.get_errno()
"""

# Exports 64 MiB of random bytes when told, then reports whether they are still what they were.
_EXPORTER = (
    _UNPRIVILEGED
    + r"""
import json, sys, torch
from kv_pipe import exported_memory

tensor = exported_memory.page_aligned_empty((64 << 20,), torch.uint8)
tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(12)))
before = tensor.clone()
print("ready", flush=True)
sys.stdin.readline()
export = exported_memory.export_host_memory(tensor)
dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
print(json.dumps({"fd": export.descriptor.fd, "nbytes": export.nbytes, "dumpable": dumpable}), flush=True)
sys.stdin.readline()
print(json.dumps(bool(torch.equal(tensor, before))), flush=True)
"""
)

# Polls the exporter's descriptors and opens and maps read-write every export it sees, as early as it
# can; once told the export is done, writes through all it got. Reports what it opened and changed.
_POLLER = (
    _UNPRIVILEGED
    + r"""
import json, mmap, sys, threading

pid = int(sys.argv[1])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
held = {}  # descriptor number in the exporter -> [our descriptor, writable mapping or None]


def map_writable(fd):
    size = os.fstat(fd).st_size
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if size else None
    except OSError:
        return None


print("polling", flush=True)
while not stop.is_set():
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            if name not in held:
                if not os.readlink(path).startswith("/memfd:kvbridge-export"):
                    continue
                held[name] = [os.open(path, os.O_RDWR | os.O_CLOEXEC), None]
            if held[name][1] is None:
                held[name][1] = map_writable(held[name][0])
        except OSError:
            pass  # not allowed now, or closed meanwhile
outcome = {"opened": sorted(held), "mapped writable": [], "written": []}
for name, (fd, mapping) in held.items():
    mapping = mapping or map_writable(fd)
    if mapping is not None:
        mapping[:8] = bytes(8 * [0xFF])
        outcome["mapped writable"].append(name)
    try:
        os.pwrite(fd, bytes(8 * [0xFF]), 0)
        outcome["written"].append(name)
    except OSError:
        pass
print(json.dumps(outcome), flush=True)
"""
)


def _line(process: subprocess.Popen, what: str) -> str:
    assert select.select([process.stdout], [], [], 120)[0], f"the {what} did not report in time"
    return process.stdout.readline()


def test_whoever_opens_the_export_while_it_is_made_cannot_write_it():
    """The file is reachable through /proc/PID/fd from its creation on, while a large storage is copied
    into it: a writable mapping made then would outlive the seal. Nobody may get one at any moment."""
    started = []
    try:
        exporter = subprocess.Popen(
            [sys.executable, "-c", _EXPORTER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=procs.REPO,
            env={**os.environ, "PYTHONPATH": str(procs.REPO)},
        )
        started.append(exporter)
        assert _line(exporter, "exporter") == "ready\n"
        poller = subprocess.Popen(
            [sys.executable, "-c", _POLLER, str(exporter.pid)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        started.append(poller)
        assert _line(poller, "poller") == "polling\n"
        exporter.stdin.write("go\n")
        exporter.stdin.flush()
        export = json.loads(_line(exporter, "exporter"))
        outcome = json.loads(poller.communicate("stop\n", timeout=120)[0])
        unchanged = json.loads(exporter.communicate("check\n", timeout=120)[0])
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
    assert [process.returncode for process in started] == [0, 0]
    assert export["nbytes"] == 64 << 20 and export["dumpable"] == 1  # it may be traced, and mapped, again
    assert str(export["fd"]) in outcome["opened"], outcome  # the poller did see and open the export
    assert outcome["mapped writable"] == [] and outcome["written"] == [], outcome
    assert unchanged is True


def test_no_export_where_the_kernel_cannot_seal_it_against_writes(monkeypatch):
    def old_kernel(fd: int, seals: int) -> None:  # before Linux 5.1: the seal is unknown
        if seals & F_SEAL_FUTURE_WRITE:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)

    monkeypatch.setattr(exported_memory, "_add_seals", old_kernel)
    monkeypatch.setattr(exported_memory, "_write_seal_refusal", None)  # ask the (old) kernel again
    tensor = torch.rand(1 << 16)
    before, address = tensor.clone(), tensor.data_ptr()
    for _ in range(2):  # the answer is remembered, and refused the same way
        with pytest.raises(KVConfigError, match=r"sealed against writes.*F_SEAL_FUTURE_WRITE.*Linux 5\.1"):
            export_host_memory(tensor)
    # Nothing was moved: the tensor's pages are still its own private memory, as they were.
    assert tensor.data_ptr() == address and same_bits(tensor, before)
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(word, 16) for word in line.split()[0].split("-"))
            assert not (start < address + tensor.nbytes and address < end and "memfd:" in line), line


# ---------------------------------------------------------------- bodies run in the child processes


def _config(rank: int, port: int, mode: str = "on") -> KVTransferConfig:
    return KVTransferConfig(
        kv_rank=rank,
        kv_port=port,
        kv_timeout=5.0,
        kv_connect_timeout=30.0,
        kv_shared_memory=mode,
        kv_buffer_size=16 << 20,
    )


def _descriptor_tensor(descriptor: ExportDescriptor, *extra: int) -> torch.Tensor:
    return torch.tensor([descriptor.fd, descriptor.inode, descriptor.nbytes, *extra], dtype=torch.int64)


def body_read_peer_export(rank: int, port: int) -> dict:
    """Rank 0 exports random bytes and changes them in place; rank 1 reads them through its mapping."""
    first, second = (random_tensor(torch.Generator().manual_seed(seed), torch.float16, (3, 70001)) for seed in (1, 2))
    with TorchDistributedPipe(_config(rank, port)) as pipe:
        if rank == 0:
            tensor = first.clone()
            export = export_host_memory(tensor)
            # The tensor starts and ends in partial pages: the export begins ``head`` bytes into it.
            pipe.send_tensor(_descriptor_tensor(export.descriptor, export.address - tensor.data_ptr()))
            assert pipe.recv_tensor(timeout=30).item() == 1  # read once
            tensor.copy_(second)
            pipe.send_tensor(torch.tensor([2]))
            assert pipe.recv_tensor(timeout=30).item() == 3
            return {}
        fd, inode, nbytes, head = pipe.recv_tensor(timeout=30).tolist()
        descriptor = ExportDescriptor(fd, inode, nbytes)
        mapped = pipe.map_peer_memory(descriptor)
        report = {"same mapping": pipe.map_peer_memory(descriptor) is mapped}
        report["first"] = torch.equal(
            _bytes_at(mapped.address_of(0, nbytes), nbytes), _flat_bits(first)[head : head + nbytes]
        )
        pipe.send_tensor(torch.tensor([1]))
        assert pipe.recv_tensor(timeout=30).item() == 2
        report["second"] = torch.equal(
            _bytes_at(mapped.address_of(0, nbytes), nbytes), _flat_bits(second)[head : head + nbytes]
        )
        with open("/proc/self/maps") as maps:
            line = next(line for line in maps if int(line.split("-")[0], 16) == mapped.address)
        report["permissions"] = line.split()[1]
        for name, call in [
            ("past the end", lambda: mapped.address_of(nbytes - 8, 16)),
            ("negative", lambda: mapped.address_of(-8, 8)),
            ("wrong inode", lambda: pipe.map_peer_memory(ExportDescriptor(fd, inode + 1, nbytes))),
            ("wrong size", lambda: pipe.map_peer_memory(ExportDescriptor(fd, inode, nbytes + PAGE))),
            ("wrong fd", lambda: pipe.map_peer_memory(ExportDescriptor(0, inode, nbytes))),
        ]:
            try:
                call()
                report[name] = "accepted"
            except KVProtocolError:
                report[name] = "refused"
        pipe.send_tensor(torch.tensor([3]))
        return report


def test_a_peer_reads_an_export_read_only_and_sees_changes():
    port = procs.free_port()
    _, report = procs.run_pair(body_read_peer_export, (0, port), (1, port), timeout=120)
    assert report.pop("permissions") == "r--s"
    assert all(value in (True, "refused") for value in report.values()), report


def body_forged_exports(rank: int, port: int) -> dict:
    """Rank 0 announces files that are not exports; rank 1 must refuse to map each of them."""
    with TorchDistributedPipe(_config(rank, port)) as pipe:
        if rank == 0:
            unsealed = os.memfd_create("kvbridge-export", os.MFD_CLOEXEC)  # the name, but shrinkable
            os.ftruncate(unsealed, 1 << 20)
            other = os.memfd_create("something-else", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(other, 1 << 20)
            fcntl.fcntl(other, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
            read, write = os.pipe()
            forged = [
                (unsealed, os.fstat(unsealed).st_ino, 1 << 20),
                (other, os.fstat(other).st_ino, 1 << 20),
                (read, os.fstat(read).st_ino, 0),
            ]
            pipe.send_tensor(torch.tensor(forged, dtype=torch.int64))
            assert pipe.recv_tensor(timeout=30) is None
            return {}
        outcomes = {}
        for fd, inode, nbytes in pipe.recv_tensor(timeout=30).tolist():
            try:
                pipe.map_peer_memory(ExportDescriptor(fd, inode, nbytes))
                outcomes[fd] = "mapped"
            except KVProtocolError as exc:
                outcomes[fd] = str(exc)
        pipe.send_tensor(None)
        return outcomes


def test_what_is_not_an_export_is_never_mapped():
    port = procs.free_port()
    _, outcomes = procs.run_pair(body_forged_exports, (0, port), (1, port), timeout=120)
    assert len(outcomes) == 3 and "mapped" not in outcomes.values(), outcomes
    assert sum("sealed" in message for message in outcomes.values()) == 1  # the unsealed memfd
    assert sum("is not a kvbridge export" in message for message in outcomes.values()) == 2


def body_transport_only(rank: int, port: int) -> str:
    with TorchDistributedPipe(_config(rank, port, mode="off")) as pipe:
        try:
            pipe.map_peer_memory(ExportDescriptor(3, 1, PAGE))
        except KVConfigError as exc:
            return str(exc)
        return "mapped"


def test_a_pipe_without_the_same_host_path_maps_nothing():
    port = procs.free_port()
    outcomes = procs.run_pair(body_transport_only, (0, port), (1, port), timeout=120)
    assert all("no same-host path" in outcome for outcome in outcomes), outcomes
