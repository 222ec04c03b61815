"""The decode role: an engine whose connector pulls prompts' KV from prefill engines.

A request arriving with ``do_remote_prefill`` waits in ``WAITING_FOR_REMOTE_KVS`` while its
blocks are pulled, then decodes; a short prompt without remote KV is prefilled locally
(conditional disaggregation). ``pdserve decode`` is ``server.py``: the shared engine server
(``pdserve/engine/server.py``) with the connector in the consumer role. The whole picture is
``docs/architecture.md``.

Life cycle of a disaggregated request on a decode engine:

1. After prefill's answer, the router sends ``Engine.Generate`` with the prompt + first token,
   ``num_prior_output_tokens=1`` and prefill's ``kv_transfer_params``
   (``RouterServicer._run()`` in ``pdserve/router/service.py``).
2. The engine core reads it from the router's framed session (``CoreSessions.read()`` in
   ``pdserve/engine/core_sessions.py``; on a ``Generate`` call the front,
   ``EngineServicer.Generate()``, forwards it with ``MPClient.add_request()``), records
   ``front_received`` and queues it with ``Scheduler.add_request()`` (event ``received``).
3. Admission: the request gets its blocks and its pull starts without waiting for a step
   boundary.
   - *Mid-step.* If a step is running, ``EngineCore.run_busy_loop()`` (``pdserve/engine/core.py``)
     takes the request in between decoder layers: the runner's layer loop calls back
     (``ModelRunner.call_between_layers()`` -> ``EngineCore._between_layers()`` ->
     ``EngineCore._take_inputs_mid_step()``). Then ``EngineCore.admit_remote_loads()`` ->
     ``Scheduler.admit_remote_loads()`` (``pdserve/engine/scheduler.py``):
     - ``PDConnector.get_num_new_matched_tokens()`` counts the prompt tokens to pull: those
       beyond the local prefix-cache hit, never the last one;
     - ``KVCacheManager.allocate_slots()`` gives the blocks;
     - ``PDConnector.update_state_after_alloc()`` queues a ``LoadJob``;
     - the request moves to ``WAITING_FOR_REMOTE_KVS`` (event ``admitted``);
     - ``PDConnector.start_load_kv()`` hands the job to the transfer thread.
   - *At a step boundary.* Otherwise ``Scheduler.schedule()`` does the same, and
     ``ModelRunner.execute_model()`` starts the load.
4. The ``kv-transfer`` thread (``TransferWorker`` in ``pdserve/connector/transfer_worker.py``):
   - ``TransferWorker._ensure_handshake()`` handshakes with the prefill engine over the side
     channel (``SideChannelClient``), once per peer instance, and makes it readable
     (``KVTransport.add_remote()``);
   - ``TransferWorker._start()`` starts the read (``KVTransport.start_read()``; event
     ``pull_start``);
   - ``TransferWorker._renew_leases()`` renews prefill's lease while the read runs.
5. The transport's thread moves the bytes into this engine's blocks. ``KVTransport._finish()``
   wakes the transfer thread through the wakeup hook (``TransferWorker.wake()``), which collects
   the result (``KVTransport.poll()``). ``TransferWorker._finish()`` records ``pull_end``, and
   ``TransferWorker._release_and_confirm()`` tells prefill to free its blocks: ``released: 1``
   confirms that the data read is valid (event ``released``).
6. The next step's ``PDConnector.get_finished()`` reports the load in ``finished_recving``
   (with ``--handover-step inflight``, also polled between decoder layers: see below).
   ``Scheduler.update_from_kv_transfers()`` marks ``load_done``, and
   ``Scheduler._remote_kv_ready()`` caches the landed blocks and sets ``num_computed_tokens`` to
   the prompt length. Only the first token is computed; its logits give the next token (events
   ``scheduled``, ``first_token``).
7. Decoding goes on like on any engine, and each token streams back to the router. When the
   request finishes, its blocks are freed at once (a consumer holds no lease).

With ``--handover-step inflight`` the landed request need not wait for the next step: while
at most half of the step's layers have run, ``EngineCore._join_landed_requests()`` (from the
between-layers callback) polls ``PDConnector.get_finished()``, hands the result to
``Scheduler.update_from_kv_transfers()``, and ``Scheduler.join_landed()`` makes the request
running and adds it to the step's ``SchedulerOutput`` as a one-token decode.
``ModelRunner.join_decodes()`` then runs that row through the layers the step has already done,
alone, and splices it into the batch for the rest (``ModelRunner._merge_joining()``): its token
comes with the step in flight. A failed load polled mid-step is carried to the step's end
instead (it may roll back running requests, which only the step's end may do).

Other paths:
- **Pull failure** (peer gone, handshake refused, deadline, release not confirmed):
  ``TransferWorker._finish()`` reports the local blocks invalid
  (``PDConnector.get_invalid_block_ids()``). ``Scheduler._handle_invalid_blocks()`` then recomputes
  from the first invalid block or fails the request, by ``--kv-load-failure-policy``.
- **Abort during the pull:** ``PDConnector.request_finished()`` returns ``(True, None)``, so the
  blocks are held until the read has ended, then freed.
- **Decode alone:** a request without ``kv_transfer_params`` is prefilled here like on a
  colocated engine (the connector answers ``(0, False)``).
"""
