"""The jobs the tests run as processes of their own (training runs that are stopped and resumed,
multi-process jobs, runs that need a process-wide setting), and ``procs``, the helpers that start them."""
