// Diagnostic only, never shipped: Scala 2.13's DefaultSerializationProxy, rewritten in Java so that a size mismatch
// ("Illegal size 5 of collection, expected 6", seen on Spark 4.3.0 when two queries of one driver submit their first
// jobs at once: docs/install.md, "Spark versions") names the collection's class and the elements it wrote, and dumps
// every thread's stack, so the thread that changed the collection can be found. The JDK's extendedDebugInfo names
// field paths only for NotSerializableException, so it cannot help here.
//
// Use (issue 41): javac -cp <pyspark>/jars/scala-library-2.13.*.jar -d <classes-dir> \
//                   dev/diagnostics/DefaultSerializationProxy.java
// then give the driver .config("spark.driver.extraClassPath", "<classes-dir>") (tests/spark_versions/links.py
// session()), which puts it before Spark's scala-library; the mismatch report goes to the driver's stderr.
package scala.collection.generic;

import java.io.IOException;
import java.io.ObjectInputStream;
import java.io.ObjectOutputStream;
import java.util.Map;

/** Diagnostic copy of Scala 2.13's proxy: on a size mismatch, names the collection and dumps every thread. */
public final class DefaultSerializationProxy<A> implements java.io.Serializable {
  private static final long serialVersionUID = 3L;
  private final scala.collection.Factory<A, Object> factory;
  private final transient scala.collection.Iterable<A> coll;
  private transient scala.collection.mutable.Builder<A, Object> builder;

  public DefaultSerializationProxy(scala.collection.Factory<A, Object> factory, scala.collection.Iterable<A> coll) {
    this.factory = factory;
    this.coll = coll;
  }

  private void writeObject(ObjectOutputStream out) throws IOException {
    out.defaultWriteObject();
    int k = coll.knownSize();
    out.writeInt(k);
    int count = 0;
    StringBuilder seen = new StringBuilder();
    scala.collection.Iterator<A> it = coll.iterator();
    while (it.hasNext()) {
      A x = it.next();
      if (seen.length() < 3000) seen.append(x == null ? "null" : x.getClass().getName() + "=" + String.valueOf(x)).append(" | ");
      out.writeObject(x);
      count++;
    }
    if (k >= 0) {
      if (count != k) {
        StringBuilder dump = new StringBuilder("LASTAGENT-DEBUG size mismatch: " + coll.getClass().getName()
            + " expected " + k + " wrote " + count + " now " + coll.knownSize() + " in thread "
            + Thread.currentThread().getName() + "\nelements written: " + seen + "\n");
        for (Map.Entry<Thread, StackTraceElement[]> e : Thread.getAllStackTraces().entrySet()) {
          dump.append("THREAD ").append(e.getKey().getName()).append("\n");
          for (StackTraceElement f : e.getValue()) dump.append("    at ").append(f).append("\n");
        }
        System.err.println(dump);
        throw new IllegalStateException("Illegal size " + count + " of collection, expected " + k + " ("
            + coll.getClass().getName() + ")");
      }
    } else {
      out.writeObject(SerializeEnd$.MODULE$);
    }
  }

  private void readObject(ObjectInputStream in) throws IOException, ClassNotFoundException {
    in.defaultReadObject();
    builder = factory.newBuilder();
    int k = in.readInt();
    if (k >= 0) {
      builder.sizeHint(k);
      for (int i = 0; i < k; i++) {
        @SuppressWarnings("unchecked") A a = (A) in.readObject();
        builder.addOne(a);
      }
    } else {
      while (true) {
        Object o = in.readObject();
        if (o == SerializeEnd$.MODULE$) break;
        @SuppressWarnings("unchecked") A a = (A) o;
        builder.addOne(a);
      }
    }
  }

  protected Object readResolve() {
    return builder.result();
  }
}
