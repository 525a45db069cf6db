// A delayed-message plugin user's producer, as written today with the RabbitMQ Java client:
// publisher confirms, an x-delay header (ms), persistent messages. The one change for
// hopsched: no exchangeDeclare(..., "x-delayed-message", ...) (hopsched declares the
// exchange; a broker without the plugin refuses that type).
//
// usage: java Producer AMQP_URL EXCHANGE ROUTING_KEY DELAY_MS...
// Delays alternate between the integer and the string form of x-delay. Each body is JSON:
// {"producer": "java", "index", "delay", "published_ms"}, published_ms taken just before
// the publish. Exits 0 once the broker confirmed every message.

import com.rabbitmq.client.AMQP;
import com.rabbitmq.client.Channel;
import com.rabbitmq.client.Connection;
import com.rabbitmq.client.ConnectionFactory;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;

public final class Producer {
    private static final long CONFIRM_TIMEOUT_MS = 15_000;

    public static void main(String[] args) throws Exception {
        if (args.length < 4) {
            System.err.println("usage: java Producer AMQP_URL EXCHANGE ROUTING_KEY DELAY_MS...");
            System.exit(2);
        }
        String exchange = args[1];
        String routingKey = args[2];
        ConnectionFactory factory = new ConnectionFactory();
        factory.setUri(args[0]);
        try (Connection connection = factory.newConnection("polyglot-java")) {
            Channel channel = connection.createChannel();
            channel.confirmSelect();
            for (int index = 0; index + 3 < args.length; index++) {
                int delay = Integer.parseInt(args[index + 3]);
                Map<String, Object> headers = new HashMap<>();
                headers.put("x-delay", index % 2 == 0 ? (Object) delay : String.valueOf(delay));
                headers.put("x-producer", "java");
                AMQP.BasicProperties properties = new AMQP.BasicProperties.Builder()
                        .deliveryMode(2)
                        .contentType("application/json")
                        .contentEncoding("utf-8")
                        .messageId(exchange + "-java-" + index)
                        .correlationId("java-" + index)
                        .appId("polyglot-java")
                        .type("order.created")
                        .headers(headers)
                        .build();
                String body = String.format(
                        "{\"producer\": \"java\", \"index\": %d, \"delay\": %d, \"published_ms\": %d}",
                        index, delay, System.currentTimeMillis());
                channel.basicPublish(
                        exchange, routingKey, properties, body.getBytes(StandardCharsets.UTF_8));
            }
            channel.waitForConfirmsOrDie(CONFIRM_TIMEOUT_MS);
            channel.close();
        }
    }
}
