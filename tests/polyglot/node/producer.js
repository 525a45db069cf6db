// A delayed-message plugin user's producer, as written today with amqplib: a confirm
// channel, an x-delay header (ms), persistent messages. The one change for hopsched: no
// assertExchange(..., 'x-delayed-message', ...) (hopsched declares the exchange; a
// broker without the plugin refuses that type).
//
// usage: node producer.js AMQP_URL EXCHANGE ROUTING_KEY DELAY_MS...
// Delays alternate between the integer and the string form of x-delay. Each body is JSON:
// {"producer": "node", "index", "delay", "published_ms"}, published_ms taken just before
// the publish. Exits 0 once the broker confirmed every message.
'use strict';

const amqp = require('amqplib');

async function main() {
  const [url, exchange, routingKey, ...delays] = process.argv.slice(2);
  if (!url || !exchange || routingKey === undefined || delays.length === 0) {
    console.error('usage: node producer.js AMQP_URL EXCHANGE ROUTING_KEY DELAY_MS...');
    process.exit(2);
  }
  const connection = await amqp.connect(url);
  try {
    const channel = await connection.createConfirmChannel();
    delays.forEach((text, index) => {
      const delay = Number.parseInt(text, 10);
      const xDelay = index % 2 === 0 ? delay : String(delay);
      const body = Buffer.from(
        JSON.stringify({ producer: 'node', index, delay, published_ms: Date.now() }),
      );
      channel.publish(exchange, routingKey, body, {
        persistent: true,
        contentType: 'application/json',
        contentEncoding: 'utf-8',
        messageId: `${exchange}-node-${index}`,
        correlationId: `node-${index}`,
        appId: 'polyglot-node',
        type: 'order.created',
        headers: { 'x-delay': xDelay, 'x-producer': 'node' },
      });
    });
    await channel.waitForConfirms();
    await channel.close();
  } finally {
    await connection.close();
  }
}

main().catch((error) => {
  console.error(`producer failed: ${error.message}`);
  process.exit(1);
});
