"""``python -m minivllm.kvstore [--port P | --unix-socket PATH] [--requirepass PW] ...``: the Redis
server of the KV-cache service under the command's name. The server itself is
``minivllm/distributed/kv_transfer/redis_server.py``, beside the connectors that keep their KV in
it; this module only re-exports its names and runs its ``main``.
"""
from minivllm.distributed.kv_transfer.redis_server import (LOOPBACK, RedisServer,
                                                           find_redis_server, main, owned_server,
                                                           read_password_file, store_url,
                                                           unguarded_warning)

__all__ = ["LOOPBACK", "RedisServer", "find_redis_server", "main", "owned_server",
           "read_password_file", "store_url", "unguarded_warning"]

if __name__ == "__main__":
    main()
