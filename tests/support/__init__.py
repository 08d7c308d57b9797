"""What tests share, and the only place they import from besides conftest: process
helpers (``procs``), models as outsiders write them (``real_models``), the in-memory
pool (``memory_pool``), a throwaway PostgreSQL (``pg_cluster``), network namespaces
(``netns``), the fakes and tables several tests use, and the worker programs the
end-to-end tests start (``cheating_worker``, ``perturbing_worker``,
``fixed_speed_worker``, ``window_probe``)."""
