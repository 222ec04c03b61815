"""The prefill role: an engine whose connector produces KV for remote decode engines.

It computes a prompt's KV and first token, then holds the blocks under a lease until the
decode engine that pulls them says it is done (``pdserve.connector.pd_connector``).
``pdserve prefill`` is ``server.py``: the shared engine server (``pdserve/engine/server.py``)
with the connector in the producer role. The whole picture is ``docs/architecture.md``.

Life cycle of a request on a prefill engine:

1. The router sends ``Engine.Generate`` with ``max_tokens=1`` and ``do_remote_decode``
   (``RouterServicer._stream_stage()`` in ``pdserve/router/service.py``).
2. On the router's framed session (its default) the engine core process reads the request
   itself (``CoreSessions.read()`` in ``pdserve/engine/core_sessions.py``), records
   ``front_received`` and refuses it there if it cannot run. On a ``Generate`` call the front
   (``EngineServicer.Generate()``) does the same and sends ``AddRequest`` over ZMQ to its core
   (``MPClient.add_request()`` in ``pdserve/engine/core_client.py``).
3. The core's busy loop (``EngineCore.run_busy_loop()`` in ``pdserve/engine/core.py``) takes the
   request in (``CoreServer.receive()``, then ``EngineCore.add_request()``), and
   ``Scheduler.add_request()`` queues it (event ``received``).
4. ``Scheduler.schedule()`` (``pdserve/engine/scheduler.py``) reuses the local prefix cache,
   allocates blocks and runs the prompt, chunked if long (events ``admitted``, ``scheduled``).
   ``ModelRunner.execute_model()`` (``pdserve/engine/runner.py``) runs the forward pass and
   samples the first token.
5. ``Scheduler.update_from_output()`` finishes the request (length 1). ``Scheduler._free_request()``
   then asks ``PDConnector.request_finished()`` (``pdserve/connector/pd_connector.py``), which:
   - registers a lease on the prompt's blocks (``LeaseTable.add()`` in
     ``pdserve/connector/leases.py``, event ``lease_registered``);
   - returns ``(True, kv_transfer_params)``: where decode finds the blocks (this engine's id,
     instance id, side-channel host and port, request id, block ids, ``num_tokens``,
     ``lease_ms``).

   The scheduler keeps the blocks in ``Scheduler.held_req_ids``. The final output carries the
   params and the request's timeline back to the router (``EngineServicer.Generate()``).
6. Decode handshakes and then reads the blocks straight from this engine's KV cache tensor
   through its transport (``pdserve/connector/transports/``):
   - the handshake: ``PDConnector._on_handshake()`` on the ``kv-side-channel`` thread
     (``SideChannelServer`` in ``pdserve/connector/side_channel.py``) checks that the KV
     layouts match;
   - during the read, ``PDConnector._on_renew()`` extends the lease (``LeaseTable.renew()``);
   - after the read, ``PDConnector._on_release()`` ends it (``LeaseTable.release()``). The
     reply (``released: 1``) is how decode knows its read is valid.
7. The next ``PDConnector.get_finished()`` returns the id in ``finished_sending``
   (``LeaseTable.take_done()``), and ``Scheduler.update_from_kv_transfers()`` frees the
   blocks. They stay in the prefix cache for the next prompt that shares them.

What ends a lease otherwise:
- **Expiry.** ``--lease-ms`` passes without a release (decode died or stalled).
  ``LeaseTable.take_done()`` reports the lease as expired, and the blocks are freed the same way.
- **Abort.** ``EngineCore.abort_requests()`` -> ``Scheduler.finish_requests()`` ->
  ``PDConnector.request_released()`` (``LeaseTable.drop()``) frees the blocks at once. A
  decode engine reading them then gets ``released: 0`` and recomputes.
- **Drain.** On SIGTERM, ``drain()`` in ``pdserve/engine/server.py`` waits for the held blocks
  (``num_held_blocks``) to reach zero, within ``--drain-timeout``.
"""
