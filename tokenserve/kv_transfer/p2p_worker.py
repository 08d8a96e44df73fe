"""`P2pConnector`, worker side: KV blocks between instances over ZMQ (TCP).

A producer serves its finished requests' blocks from a ROUTER socket bound at
`kv_ip:kv_port` (a thread): a signed pull names the request and its blocks, the reply
carries their bytes, and the request counts as sent (its blocks may be freed); a request
nobody pulls is let go after `send_timeout_s`. A consumer pulls in a thread per step's
pulls (DEALER sockets): the reply is checked (signature, nonce, size) and copied into
the request's blocks, which the scheduler holds and nothing reads until the request is
reported in `finished_recving`; any failure reports it in `failed_recving`.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time

import torch
import zmq

from tokenserve.config import KVTransferConfig
from tokenserve.kv_transfer import p2p_wire
from tokenserve.kv_transfer.p2p import P2pMetadata, Pull
from tokenserve.kv_transfer.worker_base import KVConnectorWorker

logger = logging.getLogger(__name__)

_POLL_MS = 50
# A pull that finds its request not yet registered (the producer registers it in the step
# after it finished) asks again after this long.
_RETRY_S = 0.01


class P2pConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__(config)
        extra = config.kv_connector_extra_config
        self.secret = str(extra["secret"]).encode()
        self.send_timeout_s = float(extra.get("send_timeout_s", 60.0))
        self.transfer_timeout_s = float(extra.get("transfer_timeout_s", 30.0))
        self.context = zmq.Context.instance()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Producer: request id → (its blocks, when it is let go unpulled).
        self._sends: dict[str, tuple[list[int], float]] = {}
        self._pulls: queue.Queue[tuple[str, Pull] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self.config.is_producer:
            socket = self.context.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(f"tcp://{self.config.kv_ip}:{self.config.kv_port}")
            self._start(self._serve, socket)
        if self.config.is_consumer:
            self._start(self._pull_loop)

    def start_load_kv(self, metadata: object) -> None:
        if not isinstance(metadata, P2pMetadata):
            return
        deadline = time.monotonic() + self.send_timeout_s
        with self._lock:
            for request_id, block_ids in metadata.sends.items():
                self._sends[request_id] = (block_ids, deadline)
        for request_id, pull in metadata.pulls.items():
            self._pulls.put((request_id, pull))

    def save_kv(self, metadata: object) -> None:
        """Nothing to do: a producer's blocks are served when the consumer pulls them."""

    def get_output(self, finished_req_ids: set[str]):
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, (_, deadline) in self._sends.items() if deadline < now]
            for request_id in expired:
                logger.warning("Request %s: no decode instance pulled its KV; freed.", request_id)
                del self._sends[request_id]
                self._output.finished_sending.add(request_id)
            return super().get_output(finished_req_ids)

    def shutdown(self) -> None:
        self._stop.set()
        self._pulls.put(None)
        for thread in self._threads:
            thread.join(timeout=2)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="kv-p2p")
        thread.start()
        self._threads.append(thread)

    # ---- producer --------------------------------------------------------------------

    def _serve(self, socket: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not socket.poll(_POLL_MS):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 3:
                    continue
                identity, body, mac = frames
                header, payload = self._answer(body, mac)
                reply = p2p_wire.encode(header)
                nonce = str(header.get("nonce", "")).encode()
                socket.send_multipart(
                    [identity, reply, payload, p2p_wire.sign(self.secret, nonce, reply, payload)]
                )
        finally:
            socket.close(linger=0)

    def _answer(self, body: bytes, mac: bytes) -> tuple[dict, bytes]:
        request = p2p_wire.decode(body)
        if request is None or not p2p_wire.verify(self.secret, mac, body):
            logger.warning("Refused a KV pull with a bad signature.")
            return {"status": "error", "message": "bad signature"}, b""
        nonce = request.get("nonce", "")
        request_id = request.get("request_id")
        with self._lock:
            entry = self._sends.get(request_id)
            if entry is None:
                return {"status": "not_ready", "nonce": nonce}, b""
            block_ids = request.get("block_ids") or []
            if not set(block_ids) <= set(entry[0]):
                return {"status": "error", "nonce": nonce, "message": "unknown blocks"}, b""
            payload = b"".join(self.block_bytes(block_id) for block_id in block_ids)
            # Pulled (or let go): the scheduler may free the blocks now.
            del self._sends[request_id]
            self._output.finished_sending.add(request_id)
            self._output.bytes_saved += len(payload)
        return {"status": "ok", "nonce": nonce}, payload

    # ---- consumer --------------------------------------------------------------------

    def _pull_loop(self) -> None:
        while not self._stop.is_set():
            item = self._pulls.get()
            if item is None:
                return
            request_id, pull = item
            started = time.perf_counter()
            try:
                ok = self._pull(pull)
            except (zmq.ZMQError, ValueError) as error:
                logger.warning("Request %s: KV pull failed: %s", request_id, error)
                ok = False
            if not pull.local_block_ids:
                continue  # a release: the request is not waiting for it
            with self._lock:
                if ok:
                    self._output.finished_recving.add(request_id)
                    self._output.seconds_loaded += time.perf_counter() - started
                else:
                    self._output.failed_recving.add(request_id)

    def _pull(self, pull: Pull) -> bool:
        remote = pull.remote
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://{remote.host}:{remote.port}")
        deadline = time.monotonic() + self.transfer_timeout_s
        try:
            while time.monotonic() < deadline and not self._stop.is_set():
                nonce = secrets.token_hex(16)
                body = p2p_wire.encode(
                    {
                        "request_id": remote.request_id,
                        "block_ids": pull.remote_block_ids,
                        "nonce": nonce,
                    }
                )
                socket.send_multipart([body, p2p_wire.sign(self.secret, body)])
                reply = self._receive(socket, deadline)
                if reply is None:
                    break
                header_bytes, payload, mac = reply
                header = p2p_wire.decode(header_bytes)
                if header is None or not p2p_wire.verify(
                    self.secret, mac, nonce.encode(), header_bytes, payload
                ):
                    logger.warning("A KV reply failed its signature check.")
                    return False
                if header.get("status") == "not_ready":
                    time.sleep(_RETRY_S)
                    continue
                if header.get("status") != "ok":
                    logger.warning("The prefill instance refused a KV pull: %s", header)
                    return False
                return self._write(pull, payload)
            return False
        finally:
            socket.close(linger=0)

    def _receive(self, socket: zmq.Socket, deadline: float) -> list[bytes] | None:
        while time.monotonic() < deadline and not self._stop.is_set():
            if socket.poll(_POLL_MS):
                frames = socket.recv_multipart()
                return frames if len(frames) == 3 else None
        return None

    def _write(self, pull: Pull, payload: bytes) -> bool:
        count = len(pull.local_block_ids)
        if count == 0:
            return True
        if len(payload) % count:
            return False
        size = len(payload) // count
        for index, block_id in enumerate(pull.local_block_ids):
            if not self.write_block(block_id, payload[index * size : (index + 1) * size]):
                return False
        with self._lock:
            self._output.bytes_loaded += len(payload)
        return True
