"""`oval-edge profile`: measure page_size / top-k on this device and choose one."""
