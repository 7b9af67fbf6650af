// Stub of libdispatch for the launcher check (tests/test_mps_launcher_check.py): only what
// csrc/metal/mps_launcher.mm and torch's ATen/mps headers use. Signatures as in Apple's <dispatch/queue.h>.
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);

// void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
