// Eager streams and events, for programs that do not build graphs: work enqueued on a stream
// runs in order on its device; an event (a timeline semaphore) orders work across streams and
// devices without holding a thread while it waits.
#include <cstdio>
#include <vector>

#include "weave/devices.hpp"
#include "weave/runtime.hpp"

int main() {
  weave::devices::DeviceSet devices(2, {.pin = false});
  weave::rt::Executor& executor = devices.executor();
  weave::rt::Stream producer = executor.stream(0);
  weave::rt::Stream consumer = executor.stream(1, "copy-in");
  weave::rt::Event ready("ready");
  std::vector<double> values(1000), squares(1000);

  // Device 0 writes the values, then signals the event to 1.
  producer.enqueue("produce", [&values] {
    for (std::size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<double>(i);
  });
  producer.signal(ready, 1);
  // Device 1 waits for the event on its stream (no thread blocks), then reads them.
  consumer.wait(ready, 1);
  consumer.enqueue("square", [&values, &squares] {
    for (std::size_t i = 0; i < values.size(); ++i)
      squares[i] = values[i] * values[i];
  });
  consumer.synchronize();  // the host waits for device 1's stream, helping to run it

  double sum = 0;
  for (double s : squares)
    sum += s;
  std::printf("sum of squares 0..999 computed on device 1 after device 0's event: %.0f\n", sum);
  return sum == 332833500.0 ? 0 : 1;
}
