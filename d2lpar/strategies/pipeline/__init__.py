"""Pipeline parallelism: schedules as data and their validator (``schedules``), a pure-Python player
(``simulator``), an executor on real ranks (``executor``), Gantt charts (``plot``), and
``torch.distributed.pipelining`` beside them (``torch_api``). Each imports only the ones before it."""
